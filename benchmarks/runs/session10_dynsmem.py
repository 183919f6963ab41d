"""Session 10 feasibility check (GPU): can a Triton 3.6 kernel use dynamic shared memory beyond 48 KB
through inline PTX? The PTX addresses Triton's own module-scope `global_smem` at an offset past
Triton's use, and the compiled kernel's `metadata.shared` (which sizes the launch's dynamic shared
memory and sets the >48 KB attribute when the binary is loaded) is raised before the first launch."""
import torch
import triton
import triton.language as tl


@triton.jit
def _k(x_ptr, y_ptr, OFF: tl.constexpr, N: tl.constexpr):
    t = tl.arange(0, N)
    v = tl.load(x_ptr + t)
    a = tl.inline_asm_elementwise(
        "{\n.reg .b32 a, b;\nmov.u32 a, global_smem;\nmad.lo.u32 a, $2, 4, a;\nadd.u32 a, a, $3;\n"
        "st.shared.b32 [a], $1;\nbar.sync 0;\nsub.u32 b, 127, $2;\nmov.u32 a, global_smem;\nmad.lo.u32 a, b, 4, a;\n"
        "add.u32 a, a, $3;\nld.shared.b32 $0, [a];\n}",
        "=r,r,r,r", [v, t, t * 0 + OFF], dtype=tl.int32, is_pure=False, pack=1)
    s = tl.sum(v, axis=0)  # Triton's own shared scratch at the start of the region
    tl.store(y_ptr + t, a + s)


def main():
    x = torch.arange(128, dtype=torch.int32, device="cuda")
    for off_kb, total_kb in ((32, 40), (160, 170), (200, 210)):
        y = torch.zeros_like(x)
        k = _k.warmup(x, y, OFF=off_kb * 1024, N=128, grid=(1,))
        loaded_before = k.module is not None
        if k.metadata.shared < total_kb * 1024 and len(k.packed_metadata) == 3:
            k.metadata = k.metadata._replace(shared=total_kb * 1024)
            k.packed_metadata = (k.metadata.num_warps, k.metadata.num_ctas, k.metadata.shared)
        try:
            _k[(1,)](x, y, OFF=off_kb * 1024, N=128)
            torch.cuda.synchronize()
            want = (127 - x) + int(x.sum())  # lane t reads what lane 127 - t wrote, plus Triton's sum
            ok = bool(torch.equal(y, want))
            print(f"offset {off_kb} KB, dynamic {total_kb} KB: shared={k.metadata.shared} packed={k.packed_metadata} "
                  f"loaded before patch={loaded_before} "
                  f"ok={ok}", flush=True)
        except Exception as e:  # noqa: BLE001
            print(f"offset {off_kb} KB, dynamic {total_kb} KB: {type(e).__name__}: {str(e)[:200]}", flush=True)


if __name__ == "__main__":
    main()
