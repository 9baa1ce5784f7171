#include "engine/cuda/cuda_paged_attention.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <mutex>
#include <unordered_set>

#include "kernels/cuda/model_ops.h"
#include "kernels/cuda/paged_attention.h"
#include "kernels/cuda/prefill_attention.h"
#include "kv/page_pool.h"
#include "model/cuda/device_buffer.h"
#include "model/device_attention.h"

namespace spin {

namespace {

using bf16 = __nv_bfloat16;

// Decode grids are sized for a power-of-two bound of the context (at least this), so steps whose
// longest sequence grew by a few tokens keep the same launch shape and CUDA graph.
constexpr int64_t kMinContextBucket = 64;
// Left free when the pool is sized from --gpu-memory-utilization: CUDA graphs, step tables,
// split-K workspace and the allocator's own growth come after the pool.
constexpr double kPoolMarginBytes = 1.0 * (int64_t{1} << 30);
// The decode kernel's limit on query heads per KV head.
constexpr int64_t kMaxGroup = 8;

int64_t context_bucket(int64_t tokens) {
  int64_t bucket = kMinContextBucket;
  while (bucket < tokens) bucket *= 2;
  return bucket;
}

}  // namespace

class CudaSequenceKv;

// The device pool, its page groups, and the tables of the step being run.
class CudaKvStore final : public DeviceAttention {
 public:
  CudaKvStore(const AttentionShape& shape, const CudaPagedKvConfig& config);
  ~CudaKvStore() override;
  CudaKvStore(const CudaKvStore&) = delete;
  CudaKvStore& operator=(const CudaKvStore&) = delete;

  DeviceStepLayout begin_step(std::span<const SequenceChunk> chunks, int64_t rows, cudaStream_t stream) override;
  void forward(int64_t layer, const bf16* qkv, int64_t row_stride, bf16* out, cudaStream_t stream) override;

  int64_t pages_for(int64_t tokens) const { return (tokens + page_size_ - 1) / page_size_; }
  int64_t pages_per_group() const { return shape_.n_layers * shape_.n_kv_heads; }
  int64_t usable_groups() const { return groups_total_ - 1; }
  int64_t page_size() const { return page_size_; }
  int64_t pool_bytes() const { return static_cast<int64_t>(pool_.bytes()); }

  // Grows `groups` to `count` groups, all or nothing (kv::PoolExhausted when short).
  void grow(std::vector<uint32_t>& groups, int64_t count);
  void release(std::vector<uint32_t>& groups);
  KvStoreUsage usage() const;
  std::atomic<int64_t> live_sequences{0};

 private:
  // The current step: row counts and where each table lies in the uploaded block.
  struct Step {
    int64_t rows = 0;           // rows of qkv / out, padding included
    int64_t decode_rows = 0;    // leading rows run by the decode kernel (padding included)
    int64_t prefill_seqs = 0;   // chunks of more than one token, after the decode rows
    int64_t max_new_tokens = 0; // longest prefill chunk
    int64_t context_bucket = 0; // decode kernel's max_tokens
    const int32_t* page_of = nullptr;
    const int32_t* slot_of = nullptr;
    const int32_t* decode_offsets = nullptr;
    const int32_t* decode_tokens = nullptr;
    const int32_t* decode_pages = nullptr;
    const int32_t* prefill_offsets = nullptr;
    const int32_t* prefill_token_offsets = nullptr;
    const int32_t* prefill_first_pos = nullptr;
    const int32_t* prefill_pages = nullptr;
  };

  cuda::PagedDecodeParams decode_params(int64_t decode_rows, int64_t bucket) const;

  AttentionShape shape_;
  int device_;
  int64_t page_size_;
  mutable std::mutex mutex_;  // guards groups_ (handles free into it from any thread)
  kv::IdPool groups_;         // page groups handed to sequences; the scratch group is not in it
  int64_t group_size_ = 0;    // query heads per KV head
  int64_t q_width_ = 0;
  int64_t groups_total_ = 0;  // page groups in the pool, the scratch group (the last) included
  size_t page_elems_ = 0;     // bf16 elements of one page (K then V)
  size_t layer_elems_ = 0;    // bf16 elements of one layer's slice of the pool
  DeviceBuffer<bf16> pool_;

  PinnedBuffer<int32_t> tables_host_;
  DeviceBuffer<int32_t> tables_;
  DeviceBuffer<bf16> decode_q_;      // the decode rows' q heads, contiguous (the kernel's input)
  DeviceBuffer<char> workspace_;     // split-K partial results
  cudaEvent_t upload_done_ = nullptr;
  uint64_t epoch_ = 0;
  Step step_;
};

class CudaSequenceKv final : public DeviceSequenceKv {
 public:
  CudaSequenceKv(std::shared_ptr<CudaKvStore> store, int64_t max_tokens)
      : store_(std::move(store)), max_tokens_(max_tokens) {
    ++store_->live_sequences;
  }
  ~CudaSequenceKv() override {
    store_->release(groups_);
    --store_->live_sequences;
  }
  CudaSequenceKv(const CudaSequenceKv&) = delete;
  CudaSequenceKv& operator=(const CudaSequenceKv&) = delete;

  int64_t length() const override { return length_; }
  DeviceAttention& store() override { return *store_; }

  const CudaKvStore* owner() const { return store_.get(); }
  int64_t max_tokens() const { return max_tokens_; }
  std::vector<uint32_t>& groups() { return groups_; }
  void stored(int64_t end) { length_ = std::max(length_, end); }

 private:
  std::shared_ptr<CudaKvStore> store_;
  int64_t max_tokens_;
  int64_t length_ = 0;
  std::vector<uint32_t> groups_;  // group j holds positions [j * page_size, (j + 1) * page_size)
};

namespace {

// Checks what the kernels support and returns the page groups the pool gets (the scratch group
// not counted).
uint32_t usable_pool_groups(const AttentionShape& shape, const CudaPagedKvConfig& c) {
  SPIN_CHECK(shape.n_layers > 0 && shape.n_kv_heads > 0 && shape.n_heads % shape.n_kv_heads == 0,
             "CUDA attention: bad shape ({} layers, {} heads, {} KV heads)", shape.n_layers, shape.n_heads,
             shape.n_kv_heads);
  SPIN_CHECK(shape.head_dim == 64 || shape.head_dim == 128,
             "the CUDA attention kernels support head_dim 64 or 128; this model has {}", shape.head_dim);
  const int64_t group = shape.n_heads / shape.n_kv_heads;
  SPIN_CHECK(group >= 1 && group <= kMaxGroup,
             "the CUDA attention kernels support 1..{} query heads per KV head; this model has {}", kMaxGroup, group);
  SPIN_CHECK(c.page_size >= 8 && c.page_size <= 64 && c.page_size % 8 == 0,
             "--block-size must be a multiple of 8 in 8..64 on the CUDA backend, got {}", c.page_size);
  SPIN_CHECK(c.max_batch > 0 && c.max_context > 0 && c.max_context < std::numeric_limits<int32_t>::max(),
             "CUDA KV store: max batch {} and context {} must be positive (context < 2^31)", c.max_batch,
             c.max_context);
  cuda_check(cudaSetDevice(c.device), "cudaSetDevice");

  const int64_t per_group = shape.n_layers * shape.n_kv_heads;
  const double group_bytes = static_cast<double>(per_group) * 2.0 * c.page_size * shape.head_dim * sizeof(bf16);
  int64_t usable = 0;
  if (c.device_pages > 0) {
    usable = c.device_pages / per_group;
    SPIN_CHECK(usable >= 1, "--kv-device-pages {} is less than one page per layer and KV head ({})", c.device_pages,
               per_group);
  } else {
    SPIN_CHECK(std::isfinite(c.gpu_memory_utilization) && c.gpu_memory_utilization > 0.0 &&
                   c.gpu_memory_utilization <= 1.0,
               "--gpu-memory-utilization must be in (0, 1], got {}", c.gpu_memory_utilization);
    size_t free_bytes = 0, total_bytes = 0;
    cuda_check(cudaMemGetInfo(&free_bytes, &total_bytes), "cudaMemGetInfo");
    const double in_use = static_cast<double>(total_bytes - free_bytes);
    const double budget = c.gpu_memory_utilization * static_cast<double>(total_bytes) - in_use - kPoolMarginBytes;
    SPIN_CHECK(budget >= 2.0 * group_bytes,
               "--gpu-memory-utilization {} of {:.1f} GB leaves {:.2f} GB for the KV cache after {:.1f} GB in use "
               "(weights, activations) and a {:.1f} GB margin; raise it or use a smaller model",
               c.gpu_memory_utilization, total_bytes / 1e9, std::max(budget, 0.0) / 1e9, in_use / 1e9,
               kPoolMarginBytes / 1e9);
    usable = static_cast<int64_t>(budget / group_bytes) - 1;  // one group is the padding rows' scratch
  }
  // Page ids within a layer's slice (group * kv_heads + head) are int32 in the kernels.
  const int64_t max_groups = std::numeric_limits<int32_t>::max() / shape.n_kv_heads - 1;
  return static_cast<uint32_t>(std::min(usable, max_groups));
}

}  // namespace

CudaKvStore::CudaKvStore(const AttentionShape& shape, const CudaPagedKvConfig& c)
    : shape_(shape),
      device_(c.device),
      page_size_(c.page_size),
      groups_("CUDA KV page groups", usable_pool_groups(shape, c)) {
  group_size_ = shape.n_heads / shape.n_kv_heads;
  q_width_ = shape.n_heads * shape.head_dim;
  groups_total_ = int64_t{groups_.capacity()} + 1;
  page_elems_ = static_cast<size_t>(2 * page_size_ * shape.head_dim);
  layer_elems_ = static_cast<size_t>(groups_total_ * shape.n_kv_heads) * page_elems_;
  pool_.reserve(layer_elems_ * static_cast<size_t>(shape.n_layers), "KV cache pool");
  // Zeros, not leftover bytes, in pages no token has written (benchmarks time uncomputed KV).
  cuda_check(cudaMemset(pool_.get(), 0, pool_.bytes()), "KV pool clear");
  // The clear runs on the legacy stream, which the model's non-blocking stream does not wait for.
  cuda_check(cudaDeviceSynchronize(), "KV pool clear");
  cuda_check(cudaEventCreateWithFlags(&upload_done_, cudaEventDisableTiming), "event creation");
  // Buffers for a full decode batch (rounded up as the model pads it) at full context, so serving
  // never reallocates them, which would drop the model's CUDA graphs.
  const int64_t max_rows = (c.max_batch + 7) / 8 * 8;
  const int64_t decode_entries = max_rows * shape.n_kv_heads * (pages_for(c.max_context) + 3) + 2 * max_rows + 8;
  tables_.reserve(static_cast<size_t>(decode_entries), "KV step tables");
  tables_host_.reserve(static_cast<size_t>(decode_entries));
  decode_q_.reserve(static_cast<size_t>(max_rows * q_width_), "decode queries");
  size_t workspace_bytes = 0;
  for (int64_t rows = 1; rows <= max_rows; rows = rows < 8 ? rows * 2 : rows + 8) {
    for (int64_t bucket = kMinContextBucket;; bucket *= 2) {
      workspace_bytes = std::max(workspace_bytes, cuda::paged_decode_workspace_bytes(decode_params(rows, bucket)));
      if (bucket >= c.max_context) break;
    }
  }
  workspace_.reserve(workspace_bytes, "decode split-K workspace");
  epoch_ = new_buffers_epoch();
}

CudaKvStore::~CudaKvStore() {
  // The last handle may go on any thread (the engine's): free on this store's GPU.
  cudaSetDevice(device_);
  if (upload_done_) cudaEventDestroy(upload_done_);
}

void CudaKvStore::grow(std::vector<uint32_t>& groups, int64_t count) {
  std::lock_guard lock(mutex_);
  const int64_t missing = count - static_cast<int64_t>(groups.size());
  if (missing <= 0) return;
  groups_.require(static_cast<uint64_t>(missing));
  while (static_cast<int64_t>(groups.size()) < count) groups.push_back(groups_.alloc());
}

void CudaKvStore::release(std::vector<uint32_t>& groups) {
  std::lock_guard lock(mutex_);
  for (uint32_t g : groups) groups_.free(g);
  groups.clear();
}

KvStoreUsage CudaKvStore::usage() const {
  KvStoreUsage u;
  std::lock_guard lock(mutex_);
  u.device_pages_used = int64_t{groups_.num_used()} * pages_per_group();
  u.device_pages_capacity = usable_groups() * pages_per_group();
  u.page_bytes = static_cast<int64_t>(page_elems_ * sizeof(bf16));
  u.requests = live_sequences.load();
  return u;
}

cuda::PagedDecodeParams CudaKvStore::decode_params(int64_t decode_rows, int64_t bucket) const {
  cuda::PagedDecodeParams p;
  p.q = decode_q_.get();
  p.page_ids = step_.decode_pages;
  p.list_offsets = step_.decode_offsets;
  p.num_tokens = step_.decode_tokens;
  p.num_seqs = static_cast<int>(decode_rows);
  p.num_kv_heads = static_cast<int>(shape_.n_kv_heads);
  p.group = static_cast<int>(group_size_);
  p.head_dim = static_cast<int>(shape_.head_dim);
  p.page_size = static_cast<int>(page_size_);
  p.max_tokens = static_cast<int>(bucket);
  p.scale = shape_.scale;
  return p;
}

DeviceStepLayout CudaKvStore::begin_step(std::span<const SequenceChunk> chunks, int64_t rows, cudaStream_t stream) {
  cuda_check(cudaSetDevice(device_), "cudaSetDevice");
  // The previous step's tables may still be on their way to the device.
  cuda_check(cudaEventSynchronize(upload_done_), "KV table upload");
  const int64_t heads = shape_.n_kv_heads;

  // Check the chunks before changing anything.
  std::vector<CudaSequenceKv*> seqs(chunks.size());
  std::unordered_set<const CudaSequenceKv*> seen;
  int64_t n_tokens = 0, n_single = 0, new_groups = 0;
  for (size_t i = 0; i < chunks.size(); ++i) {
    const SequenceChunk& chunk = chunks[i];
    auto* kv = dynamic_cast<CudaSequenceKv*>(chunk.attention);
    SPIN_CHECK(kv != nullptr && kv->owner() == this,
               "attention step: chunk {} holds KV that this CUDA store did not make", i);
    SPIN_CHECK(seen.insert(kv).second, "attention step: chunk {} repeats a sequence of the same step", i);
    const auto n = static_cast<int64_t>(chunk.tokens.size());
    SPIN_CHECK(n > 0, "attention step: chunk {} is empty", i);
    SPIN_CHECK(chunk.pos0 >= 0 && chunk.pos0 <= kv->length(),
               "KV cache: write at position {} leaves a gap after {}", chunk.pos0, kv->length());
    SPIN_CHECK(chunk.pos0 + n <= kv->max_tokens(), "KV cache full: {} tokens requested, capacity {}", chunk.pos0 + n,
               kv->max_tokens());
    if (n == 1) {
      SPIN_CHECK(n_single == static_cast<int64_t>(i),
                 "attention step: single-token chunks must come before longer ones (chunk {})", i);
      ++n_single;
    }
    new_groups += std::max<int64_t>(0, pages_for(chunk.pos0 + n) - static_cast<int64_t>(kv->groups().size()));
    n_tokens += n;
    seqs[i] = kv;
  }
  const auto n_chunks = static_cast<int64_t>(chunks.size());
  SPIN_CHECK(rows >= n_tokens && rows < std::numeric_limits<int32_t>::max(),
             "attention step: {} rows for {} tokens", rows, n_tokens);
  SPIN_CHECK(rows == n_tokens || n_single == n_chunks,
             "attention step: padding rows are only allowed when every chunk has one token");
  {
    std::lock_guard lock(mutex_);
    groups_.require(static_cast<uint64_t>(new_groups));  // throws before anything changed
  }
  for (size_t i = 0; i < chunks.size(); ++i) {
    grow(seqs[i]->groups(), pages_for(chunks[i].pos0 + static_cast<int64_t>(chunks[i].tokens.size())));
  }

  // Table sizes; the fixed-size tables come first so that a decode step's table addresses depend
  // on its row count alone (a CUDA graph captured for it stays valid).
  const int64_t decode_rows = n_single + (rows - n_tokens);
  const int64_t prefill_seqs = n_chunks - n_single;
  int64_t decode_page_entries = 0, prefill_page_entries = 0, max_decode_tokens = 0, max_new_tokens = 0;
  for (int64_t i = 0; i < n_chunks; ++i) {
    const SequenceChunk& chunk = chunks[static_cast<size_t>(i)];
    const int64_t end = chunk.pos0 + static_cast<int64_t>(chunk.tokens.size());
    if (i < n_single) {
      decode_page_entries += heads * pages_for(end);
      max_decode_tokens = std::max(max_decode_tokens, end);
    } else {
      prefill_page_entries += heads * pages_for(end);
      max_new_tokens = std::max<int64_t>(max_new_tokens, static_cast<int64_t>(chunk.tokens.size()));
    }
  }
  const int64_t at_page_of = 0;
  const int64_t at_slot_of = at_page_of + rows * heads;
  const int64_t at_decode_offsets = at_slot_of + rows;
  const int64_t at_decode_tokens = at_decode_offsets + decode_rows * heads + 1;
  const int64_t at_prefill_offsets = at_decode_tokens + decode_rows * heads;
  const int64_t at_prefill_token_offsets = at_prefill_offsets + prefill_seqs * heads + 1;
  const int64_t at_prefill_first_pos = at_prefill_token_offsets + prefill_seqs + 1;
  const int64_t at_decode_pages = at_prefill_first_pos + prefill_seqs;
  const int64_t at_prefill_pages = at_decode_pages + decode_page_entries;
  const int64_t total = at_prefill_pages + prefill_page_entries;
  SPIN_CHECK(total < std::numeric_limits<int32_t>::max(), "attention step: {} table entries", total);

  // Buffers the kernels read; any that moves changes the epoch (the model drops its graphs).
  const int64_t bucket = context_bucket(max_decode_tokens);
  bool moved = false;
  if (static_cast<size_t>(total) > tables_.size()) {
    moved |= tables_.reserve(static_cast<size_t>(total + total / 2), "KV step tables");
    tables_host_.reserve(tables_.size());
  }
  moved |= decode_q_.reserve(static_cast<size_t>(std::max<int64_t>(decode_rows, 1) * q_width_), "decode queries");
  if (decode_rows > 0) {
    moved |= workspace_.reserve(cuda::paged_decode_workspace_bytes(decode_params(decode_rows, bucket)),
                                "decode split-K workspace");
  }
  if (moved) epoch_ = new_buffers_epoch();

  // Fill the tables on the host.
  int32_t* t = tables_host_.get();
  const int32_t scratch = static_cast<int32_t>(groups_total_ - 1);
  auto page_id = [&](uint32_t group, int64_t head) { return static_cast<int32_t>(int64_t{group} * heads + head); };
  {
    int64_t row = 0;
    for (int64_t i = 0; i < n_chunks; ++i) {
      const SequenceChunk& chunk = chunks[static_cast<size_t>(i)];
      const std::vector<uint32_t>& groups = seqs[static_cast<size_t>(i)]->groups();
      for (size_t k = 0; k < chunk.tokens.size(); ++k, ++row) {
        const int64_t pos = chunk.pos0 + static_cast<int64_t>(k);
        for (int64_t h = 0; h < heads; ++h) t[at_page_of + row * heads + h] = page_id(groups[pos / page_size_], h);
        t[at_slot_of + row] = static_cast<int32_t>(pos % page_size_);
      }
    }
    for (; row < rows; ++row) {  // padding: the scratch group, slot 0
      for (int64_t h = 0; h < heads; ++h) t[at_page_of + row * heads + h] = page_id(static_cast<uint32_t>(scratch), h);
      t[at_slot_of + row] = 0;
    }
  }
  {
    int64_t decode_at = 0, prefill_at = 0, token_at = 0;
    t[at_decode_offsets] = 0;
    t[at_prefill_offsets] = 0;
    t[at_prefill_token_offsets] = 0;
    for (int64_t i = 0; i < n_chunks; ++i) {
      const SequenceChunk& chunk = chunks[static_cast<size_t>(i)];
      const std::vector<uint32_t>& groups = seqs[static_cast<size_t>(i)]->groups();
      const auto n = static_cast<int64_t>(chunk.tokens.size());
      const int64_t pages = pages_for(chunk.pos0 + n);
      const bool decode = i < n_single;
      const int64_t item0 = decode ? i * heads : (i - n_single) * heads;
      for (int64_t h = 0; h < heads; ++h) {
        int64_t& at = decode ? decode_at : prefill_at;
        int32_t* list = t + (decode ? at_decode_pages : at_prefill_pages) + at;
        for (int64_t j = 0; j < pages; ++j) list[j] = page_id(groups[static_cast<size_t>(j)], h);
        at += pages;
        if (decode) {
          t[at_decode_offsets + item0 + h + 1] = static_cast<int32_t>(at);
          t[at_decode_tokens + item0 + h] = static_cast<int32_t>(chunk.pos0 + n);
        } else {
          t[at_prefill_offsets + item0 + h + 1] = static_cast<int32_t>(at);
        }
      }
      if (!decode) {
        const int64_t s = i - n_single;
        token_at += n;
        t[at_prefill_token_offsets + s + 1] = static_cast<int32_t>(token_at);
        t[at_prefill_first_pos + s] = static_cast<int32_t>(chunk.pos0);
      }
    }
    for (int64_t item = n_single * heads; item < decode_rows * heads; ++item) {  // padding: no keys
      t[at_decode_offsets + item + 1] = static_cast<int32_t>(decode_at);
      t[at_decode_tokens + item] = 0;
    }
  }
  cuda_check(cudaMemcpyAsync(tables_.get(), t, static_cast<size_t>(total) * sizeof(int32_t), cudaMemcpyHostToDevice,
                             stream),
             "KV table upload");
  cuda_check(cudaEventRecord(upload_done_, stream), "KV table upload");

  for (size_t i = 0; i < chunks.size(); ++i) {
    seqs[i]->stored(chunks[i].pos0 + static_cast<int64_t>(chunks[i].tokens.size()));
  }
  const int32_t* d = tables_.get();
  step_ = Step{.rows = rows,
               .decode_rows = decode_rows,
               .prefill_seqs = prefill_seqs,
               .max_new_tokens = max_new_tokens,
               .context_bucket = bucket,
               .page_of = d + at_page_of,
               .slot_of = d + at_slot_of,
               .decode_offsets = d + at_decode_offsets,
               .decode_tokens = d + at_decode_tokens,
               .decode_pages = d + at_decode_pages,
               .prefill_offsets = d + at_prefill_offsets,
               .prefill_token_offsets = d + at_prefill_token_offsets,
               .prefill_first_pos = d + at_prefill_first_pos,
               .prefill_pages = d + at_prefill_pages};
  return DeviceStepLayout{decode_rows > 0 ? bucket : 0, epoch_};
}

void CudaKvStore::forward(int64_t layer, const bf16* qkv, int64_t row_stride, bf16* out, cudaStream_t stream) {
  SPIN_CHECK(step_.rows > 0, "attention forward before begin_step");
  SPIN_CHECK(layer >= 0 && layer < shape_.n_layers, "attention forward: layer {} of {}", layer, shape_.n_layers);
  SPIN_CHECK(row_stride >= q_width_ + 2 * shape_.n_kv_heads * shape_.head_dim,
             "attention forward: row stride {} is narrower than q, k and v", row_stride);
  bf16* pool = pool_.get() + static_cast<size_t>(layer) * layer_elems_;
  const int heads = static_cast<int>(shape_.n_kv_heads);
  const int head_dim = static_cast<int>(shape_.head_dim);
  cuda_check(cuda::store_kv_pages_bf16(qkv, row_stride, q_width_, step_.page_of, step_.slot_of, step_.rows, heads,
                                       head_dim, static_cast<int>(page_size_), pool, stream),
             "KV store");
  if (step_.decode_rows > 0) {
    // The decode kernel reads q as [rows][heads][head_dim] without a row stride.
    const size_t q_bytes = static_cast<size_t>(q_width_) * sizeof(bf16);
    cuda_check(cudaMemcpy2DAsync(decode_q_.get(), q_bytes, qkv, static_cast<size_t>(row_stride) * sizeof(bf16),
                                 q_bytes, static_cast<size_t>(step_.decode_rows), cudaMemcpyDeviceToDevice, stream),
               "decode query copy");
    cuda::PagedDecodeParams p = decode_params(step_.decode_rows, step_.context_bucket);
    p.kv_pool = pool;
    cuda_check(cuda::paged_decode_attention(p, out, workspace_.get(), workspace_.bytes(), stream),
               "paged decode attention");
  }
  if (step_.prefill_seqs > 0) {
    cuda::PagedPrefillParams p;
    p.q = qkv + step_.decode_rows * row_stride;
    p.q_row_stride = row_stride;
    p.kv_pool = pool;
    p.page_ids = step_.prefill_pages;
    p.list_offsets = step_.prefill_offsets;
    p.token_offsets = step_.prefill_token_offsets;
    p.first_pos = step_.prefill_first_pos;
    p.num_seqs = static_cast<int>(step_.prefill_seqs);
    p.num_kv_heads = heads;
    p.group = static_cast<int>(group_size_);
    p.head_dim = head_dim;
    p.page_size = static_cast<int>(page_size_);
    p.max_new_tokens = static_cast<int>(step_.max_new_tokens);
    p.scale = shape_.scale;
    cuda_check(cuda::paged_prefill_attention(p, out + step_.decode_rows * q_width_, stream),
               "paged prefill attention");
  }
}

CudaPagedAttentionFactory::CudaPagedAttentionFactory(const AttentionShape& shape, const CudaPagedKvConfig& config)
    : shape_(shape), store_(std::make_shared<CudaKvStore>(shape, config)) {}

CudaPagedAttentionFactory::~CudaPagedAttentionFactory() = default;

void CudaPagedAttentionFactory::validate(const AttentionSettings& settings) const {
  SPIN_CHECK(settings.algorithm == "dense",
             "attention algorithm '{}' is not available on the CUDA backend yet (available: dense; sparse "
             "algorithms run with --device cpu)",
             settings.algorithm);
  AttentionFactory::validate(settings);
}

std::unique_ptr<SequenceKv> CudaPagedAttentionFactory::create(const AttentionSettings& settings, int64_t max_tokens) {
  validate(settings);
  SPIN_CHECK(max_tokens > 0 && max_tokens < std::numeric_limits<int32_t>::max(),
             "attention capacity must be in 1..2^31-1, got {}", max_tokens);
  return std::make_unique<CudaSequenceKv>(store_, max_tokens);
}

KvDemand CudaPagedAttentionFactory::demand(const AttentionSettings&, int64_t tokens, int64_t, bool, int64_t) const {
  return KvDemand{.device_pages = store_->pages_for(tokens) * store_->pages_per_group()};
}

KvDemand CudaPagedAttentionFactory::capacity() const {
  return KvDemand{.device_pages = store_->usable_groups() * store_->pages_per_group()};
}

std::optional<KvStoreUsage> CudaPagedAttentionFactory::usage() const { return store_->usage(); }

void CudaPagedAttentionFactory::append_uncomputed(SequenceKv& kv, int64_t tokens) {
  auto* seq = dynamic_cast<CudaSequenceKv*>(&kv);
  SPIN_CHECK(seq != nullptr && seq->owner() == store_.get(), "append_uncomputed: KV from another store");
  const int64_t end = seq->length() + tokens;
  SPIN_CHECK(tokens >= 0 && end <= seq->max_tokens(), "KV cache full: {} tokens requested, capacity {}", end,
             seq->max_tokens());
  store_->grow(seq->groups(), store_->pages_for(end));
  seq->stored(end);
}

int64_t CudaPagedAttentionFactory::pool_bytes() const { return store_->pool_bytes(); }

int64_t CudaPagedAttentionFactory::page_size() const { return store_->page_size(); }

std::vector<std::unique_ptr<CudaPagedAttentionFactory>> make_cuda_rank_factories(const AttentionShape& rank_shape,
                                                                                 CudaPagedKvConfig config, int world) {
  SPIN_CHECK(world >= 1, "tensor parallel: the world size must be >= 1, got {}", world);
  int caller_device = 0;
  cuda_check(cudaGetDevice(&caller_device), "cudaGetDevice");
  std::vector<std::unique_ptr<CudaPagedAttentionFactory>> ranks;
  for (int r = 0; r < world; ++r) {
    config.device = r;
    ranks.push_back(std::make_unique<CudaPagedAttentionFactory>(rank_shape, config));
  }
  int64_t smallest = ranks.front()->capacity().device_pages;
  for (const auto& f : ranks) smallest = std::min(smallest, f->capacity().device_pages);
  for (int r = 0; r < world; ++r) {
    if (ranks[static_cast<size_t>(r)]->capacity().device_pages == smallest) continue;
    // Free this rank's larger pool before allocating the smaller one.
    ranks[static_cast<size_t>(r)].reset();
    config.device = r;
    config.device_pages = smallest;
    ranks[static_cast<size_t>(r)] = std::make_unique<CudaPagedAttentionFactory>(rank_shape, config);
  }
  cuda_check(cudaSetDevice(caller_device), "cudaSetDevice");  // each store set its own GPU
  return ranks;
}

}  // namespace spin
