"""Does racecheck model mbarrier release/acquire? Warp 1 reads a shared word, __syncwarp, lane 0
arrives on an mbarrier; warp 0 lane 0 waits on it, then writes the word (the Hopper forward's
tile-index hand-over). mode 0: that; mode 1: the write without the wait (a real race);
mode 2: a named barrier instead of the mbarrier (racecheck's known kind of sync)."""
import sys
import cupy as cp
src = r'''
extern "C" __global__ void probe(int mode, int* out) {
  __shared__ __align__(8) unsigned long long bar;
  __shared__ int word;
  unsigned b = (unsigned)__cvta_generic_to_shared(&bar);
  if (threadIdx.x == 0) {
    word = 7;
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(b));
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (warp == 1) {
    int v = *(volatile int*)&word;
    out[lane] = v;
    __syncwarp();
    if (mode == 2) asm volatile("bar.arrive 1, 64;" ::: "memory");
    else if (lane == 0) asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" :: "r"(b) : "memory");
  } else {
    if (mode == 2) asm volatile("bar.sync 1, 64;" ::: "memory");
    if (lane == 0) {
      if (mode == 0) {
        unsigned done = 0;
        while (!done) asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], 0;\nselp.u32 %0, 1, 0, p;\n}" : "=r"(done) : "r"(b) : "memory");
      }
      *(volatile int*)&word = 9;
    }
  }
  __syncthreads();
  if (threadIdx.x == 0 && mode == 1) {  // let the arrival complete the phase before exit
    unsigned done = 0;
    while (!done) asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], 0;\nselp.u32 %0, 1, 0, p;\n}" : "=r"(done) : "r"(b) : "memory");
  }
}
'''
mod = cp.RawModule(code=src, options=("-arch=sm_90a",))
k = mod.get_function("probe")
out = cp.zeros(32, cp.int32)
mode = int(sys.argv[1])
k((1,), (64,), (cp.int32(mode), out))
cp.cuda.runtime.deviceSynchronize()
print("mode", mode, "read", int(out[0]))
