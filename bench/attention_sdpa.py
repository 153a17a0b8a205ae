"""Which kernel torch's scaled_dot_product_attention runs on float32 inputs with TF32 off (#25
target 2's baseline; torch's profiler names it), and how close its result is to a float64
reference, beside f32 matmul-softmax-matmul's (one batch index), at bench/attention.py's
[4, 16, 1024, 128] and [8, 12, 512, 64], with a causal mask and without.

    python bench/attention_sdpa.py        # on the GPU machine (torch on cuda)

On the H200 (torch 2.11, run 132) it is the memory-efficient backend's CUTLASS kernel
(fmha_cutlassF_f32_aligned_64x128_rf_sm80 at d 128): its float32 GEMMs run on the tensor cores
as three TF32 products (cutlass's OpMultiplyAddFastF32), whatever allow_tf32 says.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile


def main() -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    b = torch.backends.cuda
    print(f"torch {torch.__version__}; matmul.allow_tf32 {b.matmul.allow_tf32}, cudnn.allow_tf32 "
          f"{torch.backends.cudnn.allow_tf32}, float32_matmul_precision {torch.get_float32_matmul_precision()}; "
          f"sdp enabled: flash {b.flash_sdp_enabled()}, mem_efficient {b.mem_efficient_sdp_enabled()}, "
          f"cudnn {b.cudnn_sdp_enabled()}, math {b.math_sdp_enabled()}")
    g = torch.Generator(device="cuda").manual_seed(0)
    for shape in ((4, 16, 1024, 128), (8, 12, 512, 64)):
        q, k, v = (torch.randn(shape, device="cuda", generator=g) for _ in range(3))
        s = shape[2]
        mask = torch.triu(torch.full((s, s), float("-inf"), device="cuda"), diagonal=1)
        for m in (mask, None):
            F.scaled_dot_product_attention(q, k, v, attn_mask=m)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=m)
                torch.cuda.synchronize()
            kernels = sorted({e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA})
            ref = torch.softmax((q[:1].double() @ k[:1].double().transpose(-1, -2)) / shape[-1] ** 0.5
                                + (0 if m is None else m.double()), -1) @ v[:1].double()
            plain = torch.softmax((q[:1] @ k[:1].transpose(-1, -2)) / shape[-1] ** 0.5 + (0 if m is None else m),
                                  -1) @ v[:1]
            err = float((out[:1].double() - ref).abs().max() / ref.abs().max())
            err_plain = float((plain.double() - ref).abs().max() / ref.abs().max())
            print(f"{'x'.join(map(str, shape))} mask {'yes' if m is not None else 'no'}: kernels {kernels}; "
                  f"vs float64: sdpa {err:.1e}, f32 matmul-softmax-matmul {err_plain:.1e}")


if __name__ == "__main__":
    main()
