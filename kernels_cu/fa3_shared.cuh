// What the Hopper forward's warpgroups meet in: the CTA's shared-memory layout (one struct, whose
// size is the kernel's dynamic shared memory), its mbarriers, and its named barriers.
#pragma once

#include "common.cuh"
#include "hopper.cuh"

// Shared memory of one CTA, after the base is aligned up to a 1024-byte swizzle atom: the Q
// buffers (buffer b holds the Q of the CTA's tiles b, b + kQBuffers, ...), O's own buffer of
// kOBytes when O has one (else kOBytes is 0 and O is staged in Q buffer 0), kStages K slots,
// kStages V slots (every tile swizzled, 1024-byte aligned), then the mbarriers and each Q
// buffer's tile index. The members are named s_* (shared memory), the accessors of Fa3Smem below
// after them. (O is 16-bit: with float8 inputs its buffer is twice a Q buffer.)
template <int kQBytes, int kQBuffers, int kOBytes, int kKVBytes, int kStages>
struct Fa3SharedStorage {
  unsigned char s_q_o[kQBuffers * kQBytes + kOBytes];
  unsigned char s_k[kStages][kKVBytes];
  unsigned char s_v[kStages][kKVBytes];
  uint64_t s_q_full[kQBuffers];   // the producer's Q load (one arrival + its bytes)
  uint64_t s_q_empty[kQBuffers];  // every consumer warp is done with the Q buffer
  uint64_t s_ring[4][kStages];    // [KvBarrier][stage]
  // The tile whose Q the producer loads into buffer b, written before its q_full arrival
  // (release) and read by the consumers after their q_full wait (acquire); a value >= the number
  // of tiles ends the CTA. Room for two buffers either way.
  int32_t s_tile[2];
  static_assert(kQBuffers <= 2, "two tile indices");
};

// The K/V ring's mbarriers, per stage: the producer's TMA load of the slot has landed (full, one
// arrival + the bytes), or every consumer warp has released it (empty).
enum class KvBarrier : int { kKFull = 0, kKEmpty = 1, kVFull = 2, kVEmpty = 3 };

// bar.sync / bar.arrive ids (0 is __syncthreads), each + the consumer index.
enum class NamedBarrier : int {
  kWarpgroup = 1,  // ids 1, 2 (, 3): one consumer warpgroup's 128 threads (epilogue, V-tail clear)
  kTurn = 4,       // ids 4, 5 (, 6): consumer c's turn to issue its wgmmas (the consumer that
                   // hands it over and consumer c: 256 threads)
};
// (An enumerator, not a constexpr variable: every constexpr variable a kernel names becomes a
// symbol of its cubin.)
enum : int { kWarpgroupThreads = 128 };

// This thread's warpgroup, broadcast from lane 0 (CUTLASS's canonical_warp_group_idx): ptxas
// then knows it is the same across the warp and keeps what derives from it (a consumer's wgmma
// descriptors, its tiles' addresses) in uniform registers; from threadIdx.x directly, every
// wgmma's descriptor was computed per thread and moved to uniform registers (R2UR) first.
CF_DEVICE int warpgroup_index() {
  return __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x) / kWarpgroupThreads, 0);
}

CF_DEVICE constexpr int named_barrier_threads(NamedBarrier id) {
  return id == NamedBarrier::kTurn ? 2 * kWarpgroupThreads : kWarpgroupThreads;
}
CF_DEVICE void named_barrier_sync(NamedBarrier id, int consumer) {
  named_barrier_sync(static_cast<int>(id) + consumer, named_barrier_threads(id));
}
CF_DEVICE void named_barrier_arrive(NamedBarrier id, int consumer) {
  named_barrier_arrive(static_cast<int>(id) + consumer, named_barrier_threads(id));
}

// Byte offset of a member in its struct (NVRTC 13.0 rejects __builtin_offsetof of a dependent
// type; the offset still folds to a constant).
template <typename T, typename M>
CF_DEVICE uint32_t member_offset(M T::* member) {
  return static_cast<uint32_t>(reinterpret_cast<size_t>(&(static_cast<T*>(nullptr)->*member)));
}

// The .shared-window addresses of a SharedStorage's members (the kernels address shared memory
// with 32-bit addresses: common.cuh, smem_addr).
template <typename Traits>
struct Fa3Smem {
  using Storage = typename Traits::SharedStorage;
  uint32_t base;  // aligned up to a 1024-byte swizzle atom

  CF_DEVICE explicit Fa3Smem(const void* smem_raw) : base(swizzle_aligned_base(smem_raw)) {}

  CF_DEVICE uint32_t q(int b) const {
    return base + member_offset(&Storage::s_q_o) + b * Traits::kQBytes;
  }
  CF_DEVICE uint32_t o() const { return Traits::Separate_o ? q(Traits::kQBuffers) : q(0); }
  CF_DEVICE uint32_t k(int stage) const {
    return base + member_offset(&Storage::s_k) + stage * Traits::kKVBytes;
  }
  CF_DEVICE uint32_t v(int stage) const {
    return base + member_offset(&Storage::s_v) + stage * Traits::kKVBytes;
  }
  CF_DEVICE uint32_t q_full(int b) const {
    return base + member_offset(&Storage::s_q_full) + 8 * b;
  }
  CF_DEVICE uint32_t q_empty(int b) const {
    return base + member_offset(&Storage::s_q_empty) + 8 * b;
  }
  CF_DEVICE uint32_t ring(KvBarrier kind, int stage) const {
    return base + member_offset(&Storage::s_ring) +
           8 * (static_cast<int>(kind) * Traits::kStages + stage);
  }
  CF_DEVICE uint32_t tile(int b) const { return base + member_offset(&Storage::s_tile) + 4 * b; }

  // One thread, before the CTA's first __syncthreads.
  CF_DEVICE void init_barriers(int consumer_warps) const {
    for (int b = 0; b < Traits::kQBuffers; ++b) {
      mbar_init(q_full(b), 1);
      mbar_init(q_empty(b), consumer_warps);  // one arrival per consumer warp
    }
    for (int s = 0; s < Traits::kStages; ++s) {
      mbar_init(ring(KvBarrier::kKFull, s), 1);
      mbar_init(ring(KvBarrier::kVFull, s), 1);
      mbar_init(ring(KvBarrier::kKEmpty, s), consumer_warps);
      mbar_init(ring(KvBarrier::kVEmpty, s), consumer_warps);
    }
    mbar_init_fence();
  }
};
