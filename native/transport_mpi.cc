// The MPI transport: Comm over an MPI communicator (Open MPI or an MPICH-ABI library). This file holds the
// check of the MPI library found at run time, the errors, the communicator's lifetime (its duplicates, dup,
// split) and make_mpi_comm; transport_mpi.h says where the rest lives.
//
// Each MpiComm owns two duplicates of the communicator it was built from: one for collectives and ring
// traffic, one for control messages, so that a control message can never match a data receive. Every MPI
// call checks its return code (the duplicates use MPI_ERRORS_RETURN) and throws TransportError.
//
// Bytes on the wire (wire.h): sendrecv and control messages count what they move. The collectives are MPI's
// own (MPI_Allreduce, MPI_Allgatherv, ...), which do not say what this rank sent to whom, so each counts the
// volume of the textbook algorithm for it (wire.h's *_volume functions), not a measurement.
//
// Sizes: MPI's counts and displacements are C ints. No single call here moves more than 1 GiB or 2^31 - 1
// elements: allreduce, broadcast and sendrecv go in pieces, and an allgatherv, alltoallv or reduce-scatter
// whose counts add up past 2^31 - 1 elements runs as a broadcast per rank, pairwise exchanges, or a reduce
// per rank, in pieces (MPI_Allgatherv and friends take int displacements, and Open MPI's reduce-scatter adds
// its counts up in an int).
#include "transport_mpi.h"

#include <cstring>
#include <list>
#include <memory>
#include <mutex>
#include <type_traits>

namespace perseus {
namespace mpi_transport {

// -- errors --------------------------------------------------------------------------------------------

std::string mpi_error_string(int code) {
  char buf[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(code, buf, &len) != MPI_SUCCESS || len <= 0) return "MPI error code " + std::to_string(code);
  return std::string(buf, static_cast<size_t>(len));
}

void to_counts(const std::vector<size_t>& counts, const char* call, const char* what, std::vector<int>* out,
               std::vector<int>* displs) {
  out->resize(counts.size());
  displs->resize(counts.size());
  size_t offset = 0;
  for (size_t r = 0; r < counts.size(); ++r) {
    (*out)[r] = to_count(counts[r], call, std::string(what) + " for rank " + std::to_string(r));
    (*displs)[r] = to_count(offset, call, std::string("the offset of rank ") + std::to_string(r) + "'s part");
    offset += counts[r];
  }
}

namespace {

// -- the MPI library -----------------------------------------------------------------------------------

// What mpi.h said at build time, to name it when the library found at run time is not the same kind.
#define PERSEUS_STR2(x) #x
#define PERSEUS_STR(x) PERSEUS_STR2(x)
#if defined(OMPI_MAJOR_VERSION)
constexpr const char* kBuiltAgainst = "Open MPI " PERSEUS_STR(OMPI_MAJOR_VERSION) "." PERSEUS_STR(
    OMPI_MINOR_VERSION) "." PERSEUS_STR(OMPI_RELEASE_VERSION);
bool same_family(const std::string& runtime) { return runtime.rfind("Open MPI", 0) == 0; }
#elif defined(MPICH_VERSION)
constexpr const char* kBuiltAgainst = "MPICH " MPICH_VERSION " (MPICH ABI)";
bool same_family(const std::string& runtime) { return runtime.find("Open MPI") == std::string::npos; }
#else
constexpr const char* kBuiltAgainst = "MPI " PERSEUS_STR(MPI_VERSION) "." PERSEUS_STR(MPI_SUBVERSION);
bool same_family(const std::string&) { return true; }
#endif

std::string first_line(const std::string& s) {
  std::string line = s.substr(0, s.find('\n'));
  while (!line.empty() && (line.back() == '\r' || line.back() == ' ' || line.back() == '\0')) line.pop_back();
  return line;
}

// A core built against one MPI may find another at run time: the library it links to by soname is then a
// second MPI that nobody initialised (mpi4py initialised its own), or not the kind of MPI its headers
// described. Both would crash or hang in the first collective; say what happened instead.
void check_library() {
  int finalized = 0, initialized = 0;
  check(MPI_Finalized(&finalized), "MPI_Finalized");
  if (finalized) throw TransportError("MPI has already been finalized");
  const std::string version = first_line(mpi_library_version());
  if (!same_family(version)) {
    throw TransportError(std::string("perseus's native core was built against ") + kBuiltAgainst +
                         " but runs with a different MPI library (" + version +
                         "); reinstall perseus from source in this environment so that it builds against "
                         "the MPI that mpi4py uses");
  }
  check(MPI_Initialized(&initialized), "MPI_Initialized");
  if (!initialized) {
    throw TransportError("the MPI library perseus's native core uses (" + version +
                         ") is not initialised, so mpi4py must have initialised a different one; reinstall "
                         "perseus from source in this environment so that it builds against the MPI that "
                         "mpi4py uses (built against " + kBuiltAgainst + ")");
  }
}

// -- requests that outlive their owner -----------------------------------------------------------------

// MPI may still read a send buffer or a count array until the request completes, and a request of a
// non-blocking collective may not be freed. What is dropped before completion is parked here for the rest
// of the process (this only happens on abnormal shutdown, so the leak is bounded).
struct Abandoned {
  std::mutex mu;
  std::vector<std::shared_ptr<void>> items;
};
Abandoned& abandoned() {
  static Abandoned* a = new Abandoned;  // never destroyed: MPI may touch the items until it finalizes
  return *a;
}

// mpi4py's Comm.handle is the MPI_Comm's value as a Python int: a pointer for Open MPI (and the MPI 5
// standard ABI), an int for MPICH. A template, so that only the matching branch is compiled.
template <typename C>
C comm_from_handle(intptr_t handle) {
  static_assert(sizeof(C) <= sizeof(intptr_t), "an MPI_Comm must fit in an intptr_t");
  if constexpr (std::is_pointer_v<C>) {
    return reinterpret_cast<C>(handle);
  } else if constexpr (std::is_integral_v<C>) {
    return static_cast<C>(handle);
  } else {
    C c;
    std::memcpy(&c, &handle, sizeof c);
    return c;
  }
}

}  // namespace

bool mpi_finalized() {
  int finalized = 1;
  return MPI_Finalized(&finalized) != MPI_SUCCESS || finalized;
}

void abandon(std::shared_ptr<void> item) {
  Abandoned& a = abandoned();
  std::lock_guard<std::mutex> lock(a.mu);
  a.items.push_back(std::move(item));
}

// -- the communicator's lifetime -----------------------------------------------------------------------

MpiComm::MpiComm(MPI_Comm parent) {
  check(MPI_Comm_dup(parent, &data_), "MPI_Comm_dup");
  try {
    check(MPI_Comm_set_errhandler(data_, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler");
    check(MPI_Comm_dup(data_, &control_), "MPI_Comm_dup");
    check(MPI_Comm_set_errhandler(control_, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler");
    check(MPI_Comm_rank(data_, &rank_), "MPI_Comm_rank");
    check(MPI_Comm_size(data_, &size_), "MPI_Comm_size");
  } catch (...) {
    free_comms();
    throw;
  }
}

MpiComm::~MpiComm() {
  try {
    if (mpi_finalized()) return;  // MPI_Finalize has freed everything already
    // Sends still in flight keep their buffers alive past this object.
    reap_sends(/*throw_errors=*/false);
    if (!outbox_.empty()) {
      abandon(std::make_shared<std::list<Outgoing>>(std::move(outbox_)));
    }
    // The communicators are not freed: a peer may still send control messages to them, or have a
    // non-blocking negotiation in flight on them, and once freed their context id can be reused by a new
    // communicator (after an elastic reset, say), which would then receive those stale messages --
    // observed as both ranks hanging in the next communicator's creation. MPI_Finalize frees them.
    data_ = control_ = MPI_COMM_NULL;
  } catch (...) {
    // A destructor must not throw; there is nothing useful left to do with an error here.
  }
}

std::unique_ptr<Comm> MpiComm::dup() {
  auto out = std::make_unique<MpiComm>(data_);
  out->set_wire_counters(wire_counters());
  return out;
}

std::unique_ptr<Comm> MpiComm::split(int color, int key) {
  MPI_Comm part = MPI_COMM_NULL;
  check(MPI_Comm_split(data_, color, key, &part), "MPI_Comm_split");
  // The Comm keeps duplicates of `part`; nothing was ever sent on it, so it can go at once.
  std::unique_ptr<Comm> out;
  try {
    out = std::make_unique<MpiComm>(part);
  } catch (...) {
    MPI_Comm_free(&part);
    throw;
  }
  MPI_Comm_free(&part);
  out->set_wire_counters(wire_counters());
  return out;
}

void MpiComm::free_comms() noexcept {
  if (control_ != MPI_COMM_NULL) MPI_Comm_free(&control_);
  if (data_ != MPI_COMM_NULL) MPI_Comm_free(&data_);
}

}  // namespace mpi_transport

std::unique_ptr<Comm> make_mpi_comm(intptr_t handle) {
  mpi_transport::check_library();
  const MPI_Comm comm = mpi_transport::comm_from_handle<MPI_Comm>(handle);
  if (comm == MPI_COMM_NULL) throw TransportError("make_mpi_comm: the communicator is MPI_COMM_NULL");
  return std::make_unique<mpi_transport::MpiComm>(comm);
}

std::string mpi_library_version() {
  char buf[MPI_MAX_LIBRARY_VERSION_STRING];
  int len = 0;
  mpi_transport::check(MPI_Get_library_version(buf, &len), "MPI_Get_library_version");
  return std::string(buf, static_cast<size_t>(len > 0 ? len : 0));
}

}  // namespace perseus
