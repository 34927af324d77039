// KV-cache store: k_cache[out_loc[t]] = k[t]; v_cache[out_loc[t]] = v[t].
//
// Rows are copied as raw bytes (dtype-agnostic), with the widest vector unit (16/8/4/2/1 bytes) that the
// segment sizes, the byte strides and the base pointers all allow. A row is num_segs segments (one per KV
// head, head_dim elements each); K and V rows may differ in size (MLA: V narrower than K, or latents of two
// widths). The head stride may differ from the segment size on either side (e.g. K/V given as a [T, H, D]
// transpose of [H, T, D]); when heads are packed back to back the row is one segment. No torch headers: the
// host launcher takes raw pointers, sizes and byte strides plus a cudaStream_t, and is loaded from Python
// with ctypes.
//
// Launch shape: blockIdx.y selects K (0) or V (1); each block handles blockDim.y tokens; threadIdx.x walks
// the vectors of one row (256 threads per block).

#include <cuda_runtime.h>
#include <stdint.h>

namespace {

struct Strides {
  int64_t src_tok;   // bytes between consecutive tokens of k (or v)
  int64_t src_seg;   // bytes between consecutive heads (segments) of one token of k (or v)
  int64_t dst_slot;  // bytes between consecutive slots of k_cache (or v_cache)
  int64_t dst_seg;   // bytes between consecutive heads of one slot of k_cache (or v_cache)
  int num_segs;      // heads (segments) per row
  int vecs_per_seg;  // copy units per segment
};

template <typename VecT, typename IdxT>
__global__ void store_rows_kernel(const char* __restrict__ k, const char* __restrict__ v,
                                  char* __restrict__ k_cache, char* __restrict__ v_cache,
                                  const IdxT* __restrict__ loc, int64_t num_tokens, Strides ks,
                                  Strides vs) {
  const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y;
  if (t >= num_tokens) return;
  const bool is_v = blockIdx.y != 0;
  const Strides s = is_v ? vs : ks;
  const int64_t slot = static_cast<int64_t>(loc[t]);
  const char* src = (is_v ? v : k) + t * s.src_tok;
  char* dst = (is_v ? v_cache : k_cache) + slot * s.dst_slot;
  const int num_segs = s.num_segs;
  const int vecs_per_seg = s.vecs_per_seg;
  if (num_segs == 1) {
    const VecT* sv = reinterpret_cast<const VecT*>(src);
    VecT* dv = reinterpret_cast<VecT*>(dst);
    for (int j = threadIdx.x; j < vecs_per_seg; j += blockDim.x) dv[j] = sv[j];
  } else {
    const int total = num_segs * vecs_per_seg;
    for (int j = threadIdx.x; j < total; j += blockDim.x) {
      const int h = j / vecs_per_seg;
      const int i = j - h * vecs_per_seg;
      const VecT* sv = reinterpret_cast<const VecT*>(src + h * s.src_seg);
      VecT* dv = reinterpret_cast<VecT*>(dst + h * s.dst_seg);
      dv[i] = sv[i];
    }
  }
}

template <typename VecT>
cudaError_t launch_vec(const void* k, const void* v, void* k_cache, void* v_cache, const void* loc,
                       int loc_is_int64, int64_t num_tokens, int64_t k_seg_bytes, int64_t v_seg_bytes,
                       Strides ks, Strides vs, cudaStream_t stream) {
  ks.vecs_per_seg = static_cast<int>(k_seg_bytes / static_cast<int64_t>(sizeof(VecT)));
  vs.vecs_per_seg = static_cast<int>(v_seg_bytes / static_cast<int64_t>(sizeof(VecT)));
  const int64_t k_vecs = static_cast<int64_t>(ks.vecs_per_seg) * ks.num_segs;
  const int64_t v_vecs = static_cast<int64_t>(vs.vecs_per_seg) * vs.num_segs;
  const int64_t row_vecs = k_vecs > v_vecs ? k_vecs : v_vecs;
  const int kThreads = 256;
  int tx = static_cast<int>(((row_vecs + 31) / 32) * 32);
  if (tx > kThreads) tx = kThreads;
  const int ty = kThreads / tx;
  const int64_t blocks = (num_tokens + ty - 1) / ty;
  if (blocks > 0x7fffffffLL) return cudaErrorInvalidConfiguration;
  dim3 grid(static_cast<unsigned>(blocks), 2, 1);
  dim3 block(tx, ty, 1);
  const char* kp = static_cast<const char*>(k);
  const char* vp = static_cast<const char*>(v);
  char* kc = static_cast<char*>(k_cache);
  char* vc = static_cast<char*>(v_cache);
  if (loc_is_int64) {
    store_rows_kernel<VecT, int64_t><<<grid, block, 0, stream>>>(
        kp, vp, kc, vc, static_cast<const int64_t*>(loc), num_tokens, ks, vs);
  } else {
    store_rows_kernel<VecT, int32_t><<<grid, block, 0, stream>>>(
        kp, vp, kc, vc, static_cast<const int32_t*>(loc), num_tokens, ks, vs);
  }
  return cudaGetLastError();
}

}  // namespace

extern "C" {

// Widest copy unit (bytes) allowed by the segment sizes, all byte strides and the base addresses.
int hf_radix_store_vec_bytes(const void* k, const void* v, const void* k_cache, const void* v_cache,
                             int64_t k_seg_bytes, int64_t v_seg_bytes, const int64_t* strides) {
  uint64_t bits = static_cast<uint64_t>(k_seg_bytes) | static_cast<uint64_t>(v_seg_bytes) |
                  reinterpret_cast<uintptr_t>(k) |
                  reinterpret_cast<uintptr_t>(v) | reinterpret_cast<uintptr_t>(k_cache) |
                  reinterpret_cast<uintptr_t>(v_cache);
  for (int i = 0; i < 8; ++i) bits |= static_cast<uint64_t>(strides[i]);
  if ((bits & 15u) == 0) return 16;
  if ((bits & 7u) == 0) return 8;
  if ((bits & 3u) == 0) return 4;
  if ((bits & 1u) == 0) return 2;
  return 1;
}

// Copies num_tokens K rows of k_num_segs segments (heads) of k_seg_bytes bytes each, and V rows of
// v_num_segs segments of v_seg_bytes. strides (bytes):
// {k_src_tok, k_src_seg, k_dst_slot, k_dst_seg, v_src_tok, v_src_seg, v_dst_slot, v_dst_seg}.
// Returns a cudaError_t (0 = success). Never synchronizes.
int hf_radix_store_kv(const void* k, const void* v, void* k_cache, void* v_cache, const void* loc,
                      int loc_is_int64, int64_t num_tokens, int k_num_segs, int64_t k_seg_bytes,
                      int v_num_segs, int64_t v_seg_bytes, const int64_t* strides, int device,
                      void* stream_handle) {
  if (num_tokens <= 0 || k_num_segs <= 0 || k_seg_bytes <= 0 || v_num_segs <= 0 || v_seg_bytes <= 0) {
    return 0;
  }
  int cur = -1;
  cudaError_t err = cudaGetDevice(&cur);
  if (err != cudaSuccess) return static_cast<int>(err);
  if (cur != device) {
    err = cudaSetDevice(device);
    if (err != cudaSuccess) return static_cast<int>(err);
  }
  Strides ks{strides[0], strides[1], strides[2], strides[3], k_num_segs, 0};
  Strides vs{strides[4], strides[5], strides[6], strides[7], v_num_segs, 0};
  // Heads packed back to back on both sides of a tensor: copy its row as one segment.
  if (k_num_segs > 1 && ks.src_seg == k_seg_bytes && ks.dst_seg == k_seg_bytes) {
    k_seg_bytes *= k_num_segs;
    ks.num_segs = 1;
  }
  if (v_num_segs > 1 && vs.src_seg == v_seg_bytes && vs.dst_seg == v_seg_bytes) {
    v_seg_bytes *= v_num_segs;
    vs.num_segs = 1;
  }
  cudaStream_t stream = static_cast<cudaStream_t>(stream_handle);
  const int vb = hf_radix_store_vec_bytes(k, v, k_cache, v_cache, k_seg_bytes, v_seg_bytes, strides);
  switch (vb) {
    case 16:
      err = launch_vec<uint4>(k, v, k_cache, v_cache, loc, loc_is_int64, num_tokens, k_seg_bytes,
                              v_seg_bytes, ks, vs, stream);
      break;
    case 8:
      err = launch_vec<uint2>(k, v, k_cache, v_cache, loc, loc_is_int64, num_tokens, k_seg_bytes,
                              v_seg_bytes, ks, vs, stream);
      break;
    case 4:
      err = launch_vec<uint32_t>(k, v, k_cache, v_cache, loc, loc_is_int64, num_tokens, k_seg_bytes,
                                 v_seg_bytes, ks, vs, stream);
      break;
    case 2:
      err = launch_vec<uint16_t>(k, v, k_cache, v_cache, loc, loc_is_int64, num_tokens, k_seg_bytes,
                                 v_seg_bytes, ks, vs, stream);
      break;
    default:
      err = launch_vec<uint8_t>(k, v, k_cache, v_cache, loc, loc_is_int64, num_tokens, k_seg_bytes,
                                 v_seg_bytes, ks, vs, stream);
      break;
  }
  if (cur != device && cur >= 0) cudaSetDevice(cur);
  return static_cast<int>(err);
}

const char* hf_radix_store_error_string(int err) { return cudaGetErrorString(static_cast<cudaError_t>(err)); }

}  // extern "C"
