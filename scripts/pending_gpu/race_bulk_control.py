"""A control for compute-sanitizer racecheck: the Hopper backward's ring protocol reduced to one
buffer of 256 bytes in shared memory, written by one producer thread and read by 4 consumer
warps with ld.shared, eight times over. The buffer's full mbarrier completes when the write lands;
its empty mbarrier takes one arrival per consumer warp once its reads are done, and the producer
waits for it before the next write (fa3_bwd.cu's Rows_by_producer rows). mode bulk: the producer
writes with cp.async.bulk and complete_tx on the full barrier (the backward's bulk_load); mode
store: with st.shared and a plain arrival (the generic proxy). Both are race-free by the PTX
memory model; racecheck's hazards under each say whether it follows that ordering. Prints each
mode and whether every consumer read what each round wrote.
    usage (GPU machine): compute-sanitizer --tool racecheck python3 scripts/pending_gpu/race_bulk_control.py"""

import cupy as cp

SOURCE = r"""
extern "C" __global__ void __launch_bounds__(160) ring(const float* src, float* out, int bulk) {
  __shared__ alignas(128) float buf[64];
  __shared__ alignas(8) unsigned long long full, empty;
  const unsigned buf_s = (unsigned)__cvta_generic_to_shared(buf);
  const unsigned full_s = (unsigned)__cvta_generic_to_shared(&full);
  const unsigned empty_s = (unsigned)__cvta_generic_to_shared(&empty);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (threadIdx.x == 0) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(full_s));
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 4;" ::"r"(empty_s));
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  auto wait = [](unsigned bar, int parity) {
    unsigned done = 0;
    while (!done)
      asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
                   "selp.u32 %0, 1, 0, p;\n}\n" : "=r"(done) : "r"(bar), "r"(parity) : "memory");
  };
  constexpr int kRounds = 8;
  if (warp == 0) {
    for (int r = 0; r < kRounds && lane == 0; ++r) {
      wait(empty_s, (r & 1) ^ 1);  // (a fresh barrier: parity 1 returns at once)
      if (bulk) {
        asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], 256;" ::"r"(full_s) : "memory");
        asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], 256, [%2];"
                     ::"r"(buf_s), "l"(src + 64 * r), "r"(full_s) : "memory");
      } else {
        for (int i = 0; i < 64; ++i) buf[i] = src[64 * r + i];
        asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(full_s) : "memory");
      }
    }
  } else {
    for (int r = 0; r < kRounds; ++r) {
      wait(full_s, r & 1);
      const float a = buf[lane], b = buf[lane + 32];
      __syncwarp();
      if (lane == 0) asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(empty_s) : "memory");
      out[((r * 4) + warp - 1) * 64 + lane] = a;
      out[((r * 4) + warp - 1) * 64 + lane + 32] = b;
    }
  }
}
"""

kernel = cp.RawModule(code=SOURCE, options=("-std=c++17", "-arch=sm_90a")).get_function("ring")
src = cp.random.standard_normal(8 * 64, dtype=cp.float32)
for mode, bulk in (("bulk", 1), ("store", 0)):
    out = cp.full((8, 4, 64), cp.nan, dtype=cp.float32)
    kernel((1,), (160,), (src, out, cp.int32(bulk)))
    cp.cuda.Device().synchronize()
    print(mode, bool((out == src.reshape(8, 1, 64)).all()), flush=True)
