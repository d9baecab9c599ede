"""Independent references of the peers' published code, for the engine to be held to, token for token.

Written from the published algorithms, not copied and not from the engine:
- `llada_modeling`  the LLaDA forward (GSAI-ML modeling_llada.py; Fast-dLLM's cache-aware copy)
- `dream_modeling`  the Dream forward (Dream-org modeling_dream.py, Qwen2 naming; Fast-dLLM's cache copy)
- `llada_generate`  LLaDA generate(), Fast-dLLM generate / prefix cache / dual cache, threshold, factor
- `dream_generate`  Dream diffusion_generate()/_sample() at temperature 0; Fast-dLLM's Dream block cache
- `checkpoints`     tiny random checkpoints written in the published formats (config.json + safetensors)

Every model reads its tensors by their published names straight from the safetensors folder and
computes in the checkpoint's dtype, in the published op order.
"""
