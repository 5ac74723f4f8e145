// Page copies between HiCache's pinned host pool and the device KV pool.
//
// Host pool:  [num_pages, num_layers, 2, chunk]                    (page-first)
// Device kv:  [num_layers, 2, num_slots, kv_heads, head_dim]       (layer-first)
// chunk = block_size * kv_heads * head_dim elements: one layer's K (or V) of one block. The chunk
// of (layer l, kv c, block b) starts at element ((l*2 + c) * num_slots + b*block_size) * kv_heads
// * head_dim of the device pool, so a page is num_layers * 2 chunks scattered over the device pool.
//
// copy_uva: one kernel moves every chunk. It dereferences the pinned host pool through its UVA
// device pointer, so one launch replaces num_layers * 2 DMA commands per page and the index
// arrays can stay on the device. copy_memcpy: the baseline, one cudaMemcpyAsync per chunk.
// Both run on the current torch stream.

#include <torch/extension.h>

// c10's stream header rather than ATen/cuda/CUDAContext.h (which pulls in cuBLAS and cuSPARSE):
// at::cuda::getCurrentCUDAStream is this same c10 function.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace {

struct Geometry {
  int64_t chunks_per_page;  // num_layers * 2
  int64_t chunk_vecs;       // 16-byte vectors per chunk
  int64_t layer_kv_vecs;    // 16-byte vectors per (layer, kv) slice of the device pool
  int64_t ctas_per_chunk;
};

// Copies vectors [begin, end) of src to dst. UNROLL independent 16-byte loads per thread are
// issued before any store, so a warp keeps many PCIe (or HBM) reads in flight. Streaming cache
// hints (.cs): the data is touched once and should not evict the model's working set from L2.
template <int UNROLL>
__device__ __forceinline__ void copy_range(const uint4* __restrict__ src, uint4* __restrict__ dst,
                                           int64_t begin, int64_t end) {
  const int64_t step = blockDim.x;
  int64_t i = begin + threadIdx.x;
  for (; i + (UNROLL - 1) * step < end; i += UNROLL * step) {
    uint4 r[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) r[u] = __ldcs(src + i + u * step);
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) __stcs(dst + i + u * step, r[u]);
  }
  for (; i < end; i += step) __stcs(dst + i, __ldcs(src + i));
}

// One CTA (or ctas_per_chunk of them) per (pair i, layer, kv) chunk; pair i moves host page
// host_pages[i] <-> device block device_blocks[i].
template <int UNROLL>
__global__ void page_copy_kernel(uint4* host, uint4* device, const int64_t* __restrict__ host_pages,
                                 const int64_t* __restrict__ device_blocks, Geometry g,
                                 bool to_device) {
  const int64_t chunk = blockIdx.x / g.ctas_per_chunk;
  const int64_t part = blockIdx.x % g.ctas_per_chunk;
  const int64_t pair = chunk / g.chunks_per_page;
  const int64_t layer_kv = chunk % g.chunks_per_page;  // layer * 2 + kv
  const int64_t host_off = (host_pages[pair] * g.chunks_per_page + layer_kv) * g.chunk_vecs;
  const int64_t dev_off = layer_kv * g.layer_kv_vecs + device_blocks[pair] * g.chunk_vecs;
  const int64_t span = (g.chunk_vecs + g.ctas_per_chunk - 1) / g.ctas_per_chunk;
  const int64_t begin = part * span;
  const int64_t end = begin + span < g.chunk_vecs ? begin + span : g.chunk_vecs;
  if (to_device) {
    copy_range<UNROLL>(host + host_off, device + dev_off, begin, end);
  } else {
    copy_range<UNROLL>(device + dev_off, host + host_off, begin, end);
  }
}

struct Layout {
  int64_t num_layers, chunk_bytes, layer_kv_bytes;
};

Layout check_layout(const torch::Tensor& host_pool, const torch::Tensor& kv, int64_t block_size) {
  TORCH_CHECK(kv.is_cuda() && kv.dim() == 5 && kv.size(1) == 2 && kv.is_contiguous(),
              "kv must be a contiguous CUDA tensor [num_layers, 2, num_slots, kv_heads, head_dim]");
  TORCH_CHECK(!host_pool.is_cuda() && host_pool.is_pinned() && host_pool.is_contiguous(),
              "host_pool must be a contiguous pinned CPU tensor");
  TORCH_CHECK(host_pool.scalar_type() == kv.scalar_type(), "host_pool and kv dtypes differ");
  TORCH_CHECK(block_size > 0 && kv.size(2) % block_size == 0,
              "num_slots must be a multiple of block_size");
  const int64_t num_layers = kv.size(0);
  const int64_t chunk = block_size * kv.size(3) * kv.size(4);
  TORCH_CHECK(host_pool.dim() >= 3 && host_pool.size(1) == num_layers && host_pool.size(2) == 2 &&
                  host_pool.numel() == host_pool.size(0) * num_layers * 2 * chunk,
              "host_pool must be [num_pages, num_layers, 2, block_size * kv_heads * head_dim]");
  const int64_t elem = kv.element_size();
  return {num_layers, chunk * elem, kv.size(2) * kv.size(3) * kv.size(4) * elem};
}

// The device-side address of the pinned pool: the host address itself for cudaHostAlloc memory
// under UVA, a mapped alias for cudaHostRegister'ed memory on systems that need one.
void* host_device_pointer(const torch::Tensor& host_pool) {
  void* dev = nullptr;
  C10_CUDA_CHECK(cudaHostGetDevicePointer(&dev, host_pool.data_ptr(), 0));
  return dev;
}

template <int UNROLL>
void launch(uint4* host, uint4* device, const torch::Tensor& pages, const torch::Tensor& blocks,
            const Geometry& g, bool to_device, int threads, cudaStream_t stream) {
  const int64_t ctas = pages.size(0) * g.chunks_per_page * g.ctas_per_chunk;
  TORCH_CHECK(ctas <= INT32_MAX, "too many pages for one launch");
  page_copy_kernel<UNROLL><<<static_cast<unsigned>(ctas), threads, 0, stream>>>(
      host, device, pages.data_ptr<int64_t>(), blocks.data_ptr<int64_t>(), g, to_device);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void copy_uva(const torch::Tensor& host_pool, const torch::Tensor& kv, const torch::Tensor& pages,
              const torch::Tensor& blocks, int64_t block_size, bool to_device, int64_t threads,
              int64_t ctas_per_chunk, int64_t unroll) {
  const Layout layout = check_layout(host_pool, kv, block_size);
  TORCH_CHECK(pages.device() == kv.device() && blocks.device() == kv.device() &&
                  pages.scalar_type() == torch::kInt64 && blocks.scalar_type() == torch::kInt64 &&
                  pages.dim() == 1 && pages.is_contiguous() && blocks.is_contiguous() &&
                  blocks.sizes() == pages.sizes(),
              "host_pages and device_blocks must be contiguous int64 [n] tensors on kv's device");
  TORCH_CHECK(layout.chunk_bytes % 16 == 0, "a chunk must be a multiple of 16 bytes");
  TORCH_CHECK(threads >= 32 && threads <= 1024 && threads % 32 == 0 && ctas_per_chunk >= 1,
              "threads must be a multiple of 32 in [32, 1024], ctas_per_chunk >= 1");
  if (pages.size(0) == 0) return;
  const c10::cuda::CUDAGuard guard(kv.device());
  auto* host = static_cast<uint4*>(host_device_pointer(host_pool));
  auto* device = static_cast<uint4*>(kv.data_ptr());
  TORCH_CHECK(reinterpret_cast<uintptr_t>(host) % 16 == 0 &&
                  reinterpret_cast<uintptr_t>(device) % 16 == 0,
              "host_pool and kv must be 16-byte aligned");
  const Geometry g{layout.num_layers * 2, layout.chunk_bytes / 16, layout.layer_kv_bytes / 16,
                   ctas_per_chunk};
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const int t = static_cast<int>(threads);
  switch (unroll) {
    case 1: return launch<1>(host, device, pages, blocks, g, to_device, t, stream);
    case 2: return launch<2>(host, device, pages, blocks, g, to_device, t, stream);
    case 4: return launch<4>(host, device, pages, blocks, g, to_device, t, stream);
    case 8: return launch<8>(host, device, pages, blocks, g, to_device, t, stream);
    default: TORCH_CHECK(false, "unroll must be 1, 2, 4 or 8, got ", unroll);
  }
}

// Baseline: one cudaMemcpyAsync per (page, layer, kv) chunk; the indices are read on the host.
void copy_memcpy(const torch::Tensor& host_pool, const torch::Tensor& kv,
                 const torch::Tensor& pages, const torch::Tensor& blocks, int64_t block_size,
                 bool to_device) {
  const Layout layout = check_layout(host_pool, kv, block_size);
  TORCH_CHECK(!pages.is_cuda() && !blocks.is_cuda() && pages.scalar_type() == torch::kInt64 &&
                  blocks.scalar_type() == torch::kInt64 && pages.dim() == 1 &&
                  blocks.sizes() == pages.sizes(),
              "host_pages and device_blocks must be int64 [n] CPU tensors");
  const c10::cuda::CUDAGuard guard(kv.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  auto* host = static_cast<char*>(host_pool.data_ptr());
  auto* device = static_cast<char*>(kv.data_ptr());
  const auto page_ids = pages.accessor<int64_t, 1>();
  const auto block_ids = blocks.accessor<int64_t, 1>();
  const int64_t per_page = layout.num_layers * 2;
  const cudaMemcpyKind kind = to_device ? cudaMemcpyHostToDevice : cudaMemcpyDeviceToHost;
  const int64_t num_blocks = kv.size(2) / block_size;
  for (int64_t i = 0; i < pages.size(0); ++i) {
    TORCH_CHECK(page_ids[i] >= 0 && page_ids[i] < host_pool.size(0) && block_ids[i] >= 0 &&
                    block_ids[i] < num_blocks,
                "page ", page_ids[i], " or block ", block_ids[i], " out of range");
    for (int64_t lk = 0; lk < per_page; ++lk) {
      char* h = host + (page_ids[i] * per_page + lk) * layout.chunk_bytes;
      char* d = device + lk * layout.layer_kv_bytes + block_ids[i] * layout.chunk_bytes;
      C10_CUDA_CHECK(to_device ? cudaMemcpyAsync(d, h, layout.chunk_bytes, kind, stream)
                               : cudaMemcpyAsync(h, d, layout.chunk_bytes, kind, stream));
    }
  }
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("copy_uva", &copy_uva, "Pinned host pages <-> device KV blocks in one UVA kernel",
        py::arg("host_pool"), py::arg("kv"), py::arg("host_pages"), py::arg("device_blocks"),
        py::arg("block_size"), py::arg("to_device"), py::arg("threads"),
        py::arg("ctas_per_chunk"), py::arg("unroll"));
  m.def("copy_memcpy", &copy_memcpy, "Pinned host pages <-> device KV blocks, a memcpy per chunk",
        py::arg("host_pool"), py::arg("kv"), py::arg("host_pages"), py::arg("device_blocks"),
        py::arg("block_size"), py::arg("to_device"));
}
