// The native unit tests' one check: EXPECT(cond) counts the check and reports a failure (file, line and the
// condition) without stopping; a test's main ends with `return expect_summary("name");` (exit status 1 if any
// check failed).
#pragma once

#include <cstdio>

namespace perseus_test {

inline int g_checks = 0;
inline int g_failures = 0;

inline void check(bool ok, const char* file, int line, const char* what) {
  ++g_checks;
  if (ok) return;
  ++g_failures;
  std::fprintf(stderr, "%s:%d: FAILED: %s\n", file, line, what);
}

inline int expect_summary(const char* name) {
  std::printf("%s: %d checks, %d failed\n", name, g_checks, g_failures);
  return g_failures == 0 ? 0 : 1;
}

}  // namespace perseus_test

#define EXPECT(cond) ::perseus_test::check((cond), __FILE__, __LINE__, #cond)
