// Page copies between HiCache's pinned host pool and the device KV pool, for any list of chunks.
//
// A model's KV cache is a list of chunks (one per (layer, cache entry): K and V of a llama layer,
// the latent of an MLA layer, ...), each a contiguous device tensor whose bytes are num_blocks_g
// blocks of block_bytes_c, block b at byte b * block_bytes_c; chunk c belongs to KV group g, and
// each group has its own block ids. A host page is one block of every group: the chunks' blocks
// back to back, in list order, page_bytes in all.
//
// Host pool:  [num_pages, page_bytes]                                        (page-first)
// Chunk c:    [num_blocks_g, block_bytes_c] at base_c, group g = group_c    (chunk-first)
// Pair i:     host page host_pages[i] <-> block device_blocks[g][i] of every chunk of group g.
//
// The per-chunk facts live in an int64 table [kRows, num_chunks] (rows in enum Row below; the
// Python side builds it once, from validated tensors, and keeps it on the device), so a copy only
// uploads its index arrays.
//
// copy_uva: one kernel moves every chunk of every pair. It dereferences the pinned host pool
// through its UVA device pointer, so one launch replaces num_chunks DMA commands per page and the
// index arrays can stay on the device. copy_memcpy: the baseline, one cudaMemcpyAsync per
// (pair, chunk). Both run on the current torch stream.

#include <torch/extension.h>

// c10's stream header rather than ATen/cuda/CUDAContext.h (which pulls in cuBLAS and cuSPARSE):
// at::cuda::getCurrentCUDAStream is this same c10 function.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace {

// Rows of the chunk table; page_copy.py's TABLE_ROWS lists the same names in the same order.
enum Row : int64_t {
  kBase = 0,        // device address of the chunk's block 0
  kBlockBytes = 1,  // bytes of one block of the chunk (a multiple of 16)
  kHostOffset = 2,  // byte offset of the chunk's block within a host page
  kGroup = 3,       // KV group: the row of device_blocks that indexes this chunk
  kNumBlocks = 4,   // blocks of that group (range checks of the memcpy baseline)
  kRows = 5,
};

constexpr int64_t kVec = 16;  // bytes per uint4, the unit every copy moves

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

struct Launch {
  int64_t num_chunks;
  int64_t num_pairs;  // n: the row length of device_blocks [num_groups, n]
  int64_t page_bytes;
  int64_t ctas_per_chunk;
};

// ctas_per_chunk CTAs' worth of work per (pair, chunk), chunk fastest: consecutive work items
// walk one host page in order. A grid smaller than the work (max_ctas) strides over it, so a
// copy that runs beside the model's kernels (a write-through on its own stream) holds a few SMs'
// slots instead of flooding every SM until it is done. Indices are trusted (the Python side
// range-checks those it uploads).
template <int UNROLL>
__global__ void page_copy_kernel(char* host, const int64_t* __restrict__ table,
                                 const int64_t* __restrict__ host_pages,
                                 const int64_t* __restrict__ device_blocks, Launch l,
                                 bool to_device) {
  const int64_t work = l.num_pairs * l.num_chunks * l.ctas_per_chunk;
  for (int64_t item = blockIdx.x; item < work; item += gridDim.x) {
    const int64_t task = item / l.ctas_per_chunk;
    const int64_t part = item % l.ctas_per_chunk;
    const int64_t pair = task / l.num_chunks;
    const int64_t c = task % l.num_chunks;
    const int64_t block_bytes = table[kBlockBytes * l.num_chunks + c];
    const int64_t group = table[kGroup * l.num_chunks + c];
    const int64_t block = device_blocks[group * l.num_pairs + pair];
    char* dev = reinterpret_cast<char*>(static_cast<intptr_t>(table[kBase * l.num_chunks + c])) +
                block * block_bytes;
    char* hst = host + host_pages[pair] * l.page_bytes + table[kHostOffset * l.num_chunks + c];
    const int64_t vecs = block_bytes / kVec;
    const int64_t span = (vecs + l.ctas_per_chunk - 1) / l.ctas_per_chunk;
    const int64_t begin = part * span < vecs ? part * span : vecs;
    const int64_t end = begin + span < vecs ? begin + span : vecs;
    auto* d = reinterpret_cast<uint4*>(dev);
    auto* h = reinterpret_cast<uint4*>(hst);
    if (to_device) {
      copy_range<UNROLL>(h, d, begin, end);
    } else {
      copy_range<UNROLL>(d, h, begin, end);
    }
  }
}

void check_host_pool(const torch::Tensor& host_pool, int64_t page_bytes) {
  TORCH_CHECK(page_bytes > 0 && page_bytes % kVec == 0,
              "page_bytes must be a positive multiple of 16, got ", page_bytes);
  TORCH_CHECK(!host_pool.is_cuda() && host_pool.is_pinned() && host_pool.is_contiguous() &&
                  host_pool.dim() >= 1,
              "host_pool must be a contiguous pinned CPU tensor");
  TORCH_CHECK(host_pool.nbytes() == static_cast<size_t>(host_pool.size(0) * page_bytes),
              "host_pool must hold [num_pages, ", page_bytes, "] bytes");
}

void check_table(const torch::Tensor& table) {
  TORCH_CHECK(table.scalar_type() == torch::kInt64 && table.dim() == 2 &&
                  table.size(0) == kRows && table.size(1) >= 1 && table.is_contiguous(),
              "the chunk table must be a contiguous int64 [", kRows, ", num_chunks] tensor");
}

void check_indices(const torch::Tensor& pages, const torch::Tensor& blocks) {
  TORCH_CHECK(pages.scalar_type() == torch::kInt64 && blocks.scalar_type() == torch::kInt64 &&
                  pages.dim() == 1 && blocks.dim() == 2 && blocks.size(0) >= 1 &&
                  blocks.size(1) == pages.size(0) && pages.is_contiguous() &&
                  blocks.is_contiguous(),
              "host_pages must be a contiguous int64 [n] tensor and device_blocks a contiguous "
              "int64 [num_groups, n] tensor");
}

// The device-side address of the pinned pool: the host address itself for cudaHostAlloc memory
// under UVA, a mapped alias for cudaHostRegister'ed memory on systems that need one.
char* host_device_pointer(const torch::Tensor& host_pool) {
  void* dev = nullptr;
  C10_CUDA_CHECK(cudaHostGetDevicePointer(&dev, host_pool.data_ptr(), 0));
  return static_cast<char*>(dev);
}

template <int UNROLL>
void launch(char* host, const torch::Tensor& table, const torch::Tensor& pages,
            const torch::Tensor& blocks, const Launch& l, bool to_device, int threads,
            int64_t max_ctas, cudaStream_t stream) {
  int64_t ctas = l.num_pairs * l.num_chunks * l.ctas_per_chunk;
  if (max_ctas > 0 && ctas > max_ctas) ctas = max_ctas;
  TORCH_CHECK(ctas <= INT32_MAX, "too many pages for one launch");
  page_copy_kernel<UNROLL><<<static_cast<unsigned>(ctas), threads, 0, stream>>>(
      host, table.data_ptr<int64_t>(), pages.data_ptr<int64_t>(), blocks.data_ptr<int64_t>(), l,
      to_device);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void copy_uva(const torch::Tensor& host_pool, const torch::Tensor& table, int64_t page_bytes,
              const torch::Tensor& pages, const torch::Tensor& blocks, bool to_device,
              int64_t threads, int64_t ctas_per_chunk, int64_t unroll, int64_t max_ctas) {
  check_host_pool(host_pool, page_bytes);
  check_table(table);
  check_indices(pages, blocks);
  TORCH_CHECK(table.is_cuda() && pages.device() == table.device() &&
                  blocks.device() == table.device(),
              "the chunk table, host_pages and device_blocks must be on the chunks' device");
  TORCH_CHECK(threads >= 32 && threads <= 1024 && threads % 32 == 0 && ctas_per_chunk >= 1,
              "threads must be a multiple of 32 in [32, 1024], ctas_per_chunk >= 1");
  TORCH_CHECK(max_ctas >= 0, "max_ctas must be >= 0 (0: one CTA per work item)");
  if (pages.size(0) == 0) return;
  const c10::cuda::CUDAGuard guard(table.device());
  char* host = host_device_pointer(host_pool);
  TORCH_CHECK(reinterpret_cast<uintptr_t>(host) % kVec == 0, "host_pool must be 16-byte aligned");
  const Launch l{table.size(1), pages.size(0), page_bytes, ctas_per_chunk};
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const int t = static_cast<int>(threads);
  switch (unroll) {
    case 1: return launch<1>(host, table, pages, blocks, l, to_device, t, max_ctas, stream);
    case 2: return launch<2>(host, table, pages, blocks, l, to_device, t, max_ctas, stream);
    case 4: return launch<4>(host, table, pages, blocks, l, to_device, t, max_ctas, stream);
    case 8: return launch<8>(host, table, pages, blocks, l, to_device, t, max_ctas, stream);
    default: TORCH_CHECK(false, "unroll must be 1, 2, 4 or 8, got ", unroll);
  }
}

// Baseline: one cudaMemcpyAsync per (pair, chunk); the table and indices are read on the host.
void copy_memcpy(const torch::Tensor& host_pool, const torch::Tensor& table, int64_t page_bytes,
                 const torch::Tensor& pages, const torch::Tensor& blocks, bool to_device,
                 int64_t device_index) {
  check_host_pool(host_pool, page_bytes);
  check_table(table);
  check_indices(pages, blocks);
  TORCH_CHECK(!table.is_cuda() && !pages.is_cuda() && !blocks.is_cuda(),
              "copy_memcpy reads the chunk table and the indices on the host: pass CPU tensors");
  const int64_t num_chunks = table.size(1);
  const int64_t n = pages.size(0);
  const auto t = table.accessor<int64_t, 2>();
  const auto page_ids = pages.accessor<int64_t, 1>();
  const auto block_ids = blocks.accessor<int64_t, 2>();
  for (int64_t c = 0; c < num_chunks; ++c) {
    TORCH_CHECK(t[kGroup][c] >= 0 && t[kGroup][c] < blocks.size(0), "chunk ", c, " names group ",
                t[kGroup][c], " but device_blocks has ", blocks.size(0), " rows");
  }
  // Every index is checked before the first copy is enqueued, so a bad one copies nothing.
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(page_ids[i] >= 0 && page_ids[i] < host_pool.size(0), "host page ", page_ids[i],
                " out of range [0, ", host_pool.size(0), ")");
    for (int64_t c = 0; c < num_chunks; ++c) {
      const int64_t block = block_ids[t[kGroup][c]][i];
      TORCH_CHECK(block >= 0 && block < t[kNumBlocks][c], "block ", block, " of group ",
                  t[kGroup][c], " out of range [0, ", t[kNumBlocks][c], ")");
    }
  }
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_index));
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  auto* host = static_cast<char*>(host_pool.data_ptr());
  const cudaMemcpyKind kind = to_device ? cudaMemcpyHostToDevice : cudaMemcpyDeviceToHost;
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t c = 0; c < num_chunks; ++c) {
      const int64_t block = block_ids[t[kGroup][c]][i];
      const int64_t bytes = t[kBlockBytes][c];
      char* h = host + page_ids[i] * page_bytes + t[kHostOffset][c];
      char* d = reinterpret_cast<char*>(static_cast<intptr_t>(t[kBase][c])) + block * bytes;
      C10_CUDA_CHECK(to_device ? cudaMemcpyAsync(d, h, bytes, kind, stream)
                               : cudaMemcpyAsync(h, d, bytes, kind, stream));
    }
  }
}

// Exactly nbytes of pinned host memory (under UVA, which 64-bit CUDA always has, it is mapped
// into every device's address space and portable), freed with the tensor. torch's pinned
// allocator would round the request up to a power of two.
torch::Tensor pinned_empty(int64_t nbytes, int64_t device_index) {
  TORCH_CHECK(nbytes > 0, "a pinned buffer needs at least one byte, got ", nbytes);
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_index));
  void* ptr = nullptr;
  C10_CUDA_CHECK(cudaHostAlloc(&ptr, static_cast<size_t>(nbytes), cudaHostAllocDefault));
  // The deleter may run at interpreter exit, after the CUDA context is gone: its error is moot.
  return torch::from_blob(ptr, {nbytes}, [](void* p) { (void)cudaFreeHost(p); },
                          torch::TensorOptions().dtype(torch::kUInt8));
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("copy_uva", &copy_uva, "Pinned host pages <-> device KV chunks in one UVA kernel",
        py::arg("host_pool"), py::arg("table"), py::arg("page_bytes"), py::arg("host_pages"),
        py::arg("device_blocks"), py::arg("to_device"), py::arg("threads"),
        py::arg("ctas_per_chunk"), py::arg("unroll"), py::arg("max_ctas") = 0);
  m.def("copy_memcpy", &copy_memcpy, "Pinned host pages <-> device KV chunks, a memcpy per chunk",
        py::arg("host_pool"), py::arg("table"), py::arg("page_bytes"), py::arg("host_pages"),
        py::arg("device_blocks"), py::arg("to_device"), py::arg("device_index"));
  m.def("pinned_empty", &pinned_empty, "Exactly nbytes of pinned host memory, uint8 [nbytes]",
        py::arg("nbytes"), py::arg("device_index"));
}
