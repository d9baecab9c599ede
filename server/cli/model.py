"""What `--model` and `--device` name, checked and resolved before anything loads.

- `--device cuda` on a torch that cannot run CUDA is one line naming the installed build and how
  to get the CUDA one, instead of torch's "Torch not compiled with CUDA enabled" traceback.
- A model is a checkpoint folder, an embedded model's name (celeris-tiny), or a Hugging Face id
  (`GSAI-ML/LLaDA-8B-Instruct`), as vLLM, SGLang and transformers take it: resolved through the
  Hugging Face cache with huggingface_hub (`--revision`, `--download-dir`), offline when
  HF_HUB_OFFLINE=1 and downloading when online.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from celeris.engine.errors import EngineError, ModelLoadError

CUDA_INDEX = "https://download.pytorch.org/whl/cu130"  # the variant deploy/Dockerfile.cuda installs
# org/name: what the Hub accepts as a repo id (letters, digits, - _ .), never a path that exists.
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def check_device(device: str) -> None:
    """Raise EngineError (one line) when torch cannot run on `device`; cpu always can."""
    if not device.startswith("cuda"):
        return
    import torch

    if torch.version.cuda is None:
        raise EngineError(f"--device {device}: the installed torch {torch.__version__} is a CPU-only build; install "
                          f"the CUDA build with `pip install --force-reinstall --index-url {CUDA_INDEX} "
                          f"torch=={torch.__version__.split('+')[0]}`")
    if not torch.cuda.is_available():
        raise EngineError(f"--device {device}: torch {torch.__version__} is built for CUDA {torch.version.cuda} but "
                          "finds no GPU (check nvidia-smi, the driver and CUDA_VISIBLE_DEVICES)")
    index = int(device.split(":", 1)[1]) if ":" in device else 0
    if index >= torch.cuda.device_count():
        raise EngineError(f"--device {device}: torch sees {torch.cuda.device_count()} GPU(s)")


@dataclass(frozen=True)
class ModelSource:
    """Where the weights are: `path` for LLM.load (None: the embedded default); `repo_id` when
    it came from the Hugging Face Hub (the name clients use by default, as in vLLM)."""

    path: Optional[str]
    repo_id: Optional[str] = None


def is_repo_id(model: str) -> bool:
    """Whether `model` reads as a Hub id rather than a folder: org/name, and no such folder here."""
    return bool(_REPO_ID.match(model)) and not Path(model).exists()


def resolve_model(model: Optional[str], revision: Optional[str] = None,
                  download_dir: Optional[str] = None) -> ModelSource:
    """A folder or an embedded name as given; a Hub id as its snapshot folder in the cache
    (`download_dir`, else huggingface_hub's: $HF_HUB_CACHE, $HF_HOME/hub, ~/.cache/huggingface/hub)."""
    if model is None or not is_repo_id(model):
        if revision is not None:
            raise ModelLoadError(f"--revision {revision}: --model {model or 'celeris-tiny'} is not a Hugging Face id")
        return ModelSource(model)
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import (HFValidationError, LocalEntryNotFoundError, RepositoryNotFoundError,
                                            RevisionNotFoundError)
    except ImportError:  # a declared dependency; only a broken install lacks it
        raise ModelLoadError(f"{model} looks like a Hugging Face id but huggingface_hub is not installed") from None
    try:
        folder = snapshot_download(model, revision=revision, cache_dir=download_dir)
    except LocalEntryNotFoundError:
        from huggingface_hub import constants

        where = download_dir or constants.HF_HUB_CACHE
        why = "HF_HUB_OFFLINE=1 is set" if constants.HF_HUB_OFFLINE else "the Hub cannot be reached"
        raise ModelLoadError(f"{model}{'@' + revision if revision else ''} is not in {where} and {why}; download "
                             f"it where the Hub is reachable (`hf download {model}`), or give a folder") from None
    except RevisionNotFoundError:
        raise ModelLoadError(f"--revision {revision}: no such revision of {model}") from None
    except (RepositoryNotFoundError, HFValidationError) as e:
        raise ModelLoadError(f"{model}: not a model on the Hugging Face Hub ({type(e).__name__}), "
                             "and no folder of that name") from None
    return ModelSource(folder, repo_id=model)


def model_from_args(a) -> ModelSource:
    """The model a command names (serve's positional or --model, not both), the device checked
    first: both fail in one line before anything loads."""
    positional = getattr(a, "model_tag", None)
    if positional is not None and a.model is not None and positional != a.model:
        raise EngineError(f"two models named: {positional} and --model {a.model}; give one")
    check_device(a.device)
    source = resolve_model(positional or a.model, getattr(a, "revision", None), getattr(a, "download_dir", None))
    from celeris.server.cli.vllm_flags import resolve_dtype

    resolve_dtype(a, source.path)  # --dtype auto: the checkpoint's, known once the folder is
    return source
