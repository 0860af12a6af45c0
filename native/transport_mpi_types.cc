// The MPI transport's datatypes and reductions (see transport_mpi.h): the MPI datatype of every dtype and
// the MPI reduction of every (dtype, op).
//
// float16 and bfloat16 have no MPI type: they travel as two distinct 2-byte types of this transport's own,
// reduced by user-defined ops over the native kernels (in float32, rounded once per combine). The types and
// ops are created once per process, on first use (any rank may be first; creation is not collective), and
// never freed. Creating them throws TransportError when MPI fails.
#include "transport_mpi.h"

#include <cstdio>
#include <cstdlib>
#include <mutex>

#include "kernels.h"

namespace perseus {
namespace mpi_transport {
namespace {

// float16 and bfloat16 travel as two distinct 2-byte types, so that one user-defined reduction can tell
// them apart by the datatype MPI hands it. Created once per process and never freed: MPI_Finalize
// releases them, and an op may still be referenced by a request in flight at any earlier point.
struct HalfFloatTypes {
  MPI_Datatype f16 = MPI_DATATYPE_NULL;
  MPI_Datatype bf16 = MPI_DATATYPE_NULL;
  MPI_Op sum = MPI_OP_NULL, min = MPI_OP_NULL, max = MPI_OP_NULL, product = MPI_OP_NULL;
};
HalfFloatTypes g_half;
std::once_flag g_half_once;

template <ReduceOp Op>
void reduce_16bit(void* in, void* inout, int* len, MPI_Datatype* type) {
  DType dtype;
  if (*type == g_half.f16) {
    dtype = DType::FLOAT16;
  } else if (*type == g_half.bf16) {
    dtype = DType::BFLOAT16;
  } else {
    // Only the MPI transport uses these ops, always with the types above: anything else is memory corruption.
    std::fprintf(stderr, "perseus: a 16-bit float reduction received an unknown MPI datatype\n");
    std::abort();
  }
  combine(in, inout, inout, static_cast<size_t>(*len), dtype, Op);
}

MPI_Datatype make_2byte_type(const char* name) {
  MPI_Datatype t;
  check(MPI_Type_contiguous(2, MPI_BYTE, &t), "MPI_Type_contiguous");
  check(MPI_Type_commit(&t), "MPI_Type_commit");
  MPI_Type_set_name(t, name);  // only for debuggers and error messages
  return t;
}

MPI_Op make_op(MPI_User_function* fn) {
  MPI_Op op;
  check(MPI_Op_create(fn, /*commute=*/1, &op), "MPI_Op_create");
  return op;
}

const HalfFloatTypes& half_types() {
  // If creation throws, call_once leaves the flag unset and the next caller tries again.
  std::call_once(g_half_once, [] {
    HalfFloatTypes r;
    r.f16 = make_2byte_type("perseus_float16");
    r.bf16 = make_2byte_type("perseus_bfloat16");
    r.sum = make_op(&reduce_16bit<ReduceOp::SUM>);
    r.min = make_op(&reduce_16bit<ReduceOp::MIN>);
    r.max = make_op(&reduce_16bit<ReduceOp::MAX>);
    r.product = make_op(&reduce_16bit<ReduceOp::PRODUCT>);
    g_half = r;
  });
  return g_half;
}

}  // namespace

MPI_Datatype mpi_type(DType dtype) {
  switch (dtype) {
    case DType::UINT8: return MPI_UINT8_T;
    case DType::INT8: return MPI_INT8_T;
    case DType::INT16: return MPI_INT16_T;
    case DType::INT32: return MPI_INT32_T;
    case DType::INT64: return MPI_INT64_T;
    case DType::UINT16: return MPI_UINT16_T;
    case DType::FLOAT32: return MPI_FLOAT;
    case DType::FLOAT64: return MPI_DOUBLE;
    case DType::BOOL: return MPI_C_BOOL;
    case DType::FLOAT16: return half_types().f16;
    case DType::BFLOAT16: return half_types().bf16;
  }
  throw TransportError("unknown dtype " + std::to_string(static_cast<int>(dtype)));
}

MPI_Op mpi_op(DType dtype, ReduceOp op) {
  if (op == ReduceOp::ADASUM) throw TransportError("Adasum is not an MPI reduction");
  if (dtype == DType::BOOL) {
    return (op == ReduceOp::MIN || op == ReduceOp::PRODUCT) ? MPI_LAND : MPI_LOR;
  }
  if (dtype == DType::FLOAT16 || dtype == DType::BFLOAT16) {
    const HalfFloatTypes& r = half_types();
    switch (op) {
      case ReduceOp::MIN: return r.min;
      case ReduceOp::MAX: return r.max;
      case ReduceOp::PRODUCT: return r.product;
      default: return r.sum;  // SUM, and AVERAGE (a sum plus a postscale)
    }
  }
  switch (op) {
    case ReduceOp::MIN: return MPI_MIN;
    case ReduceOp::MAX: return MPI_MAX;
    case ReduceOp::PRODUCT: return MPI_PROD;
    default: return MPI_SUM;
  }
}

}  // namespace mpi_transport
}  // namespace perseus
