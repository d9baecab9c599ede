"""Test-side references for block-diffusion models (SDAR, LLaDA2.x).

Written from the published algorithms, independently of `engine/`:
- `checkpoints`: tiny random SDAR- and LLaDA2-format folders (published config keys and tensor names);
- `modeling`: a plain forward for each architecture with a KV cache and the block-causal mask;
- `generate`: the published reverse loops (SDAR `block_diffusion_generate`, LLaDA2 `generate`) at
  temperature 0.
"""
