"""A Hugging Face hub cache laid out on disk, as huggingface_hub writes a download."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

from celeris.engine.llm import EMBEDDED_MODEL


REPO_ID = "celeris-org/celeris-tiny"

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def hf_cache(root: Path, repo_id: str = REPO_ID, commit: str = COMMIT, source: Path = EMBEDDED_MODEL) -> Path:
    """A Hugging Face hub cache holding `source` as huggingface_hub lays a download out:
    models--org--name/blobs/<sha256> (the files), snapshots/<commit>/<file> -> ../../blobs/<sha256>
    (relative links), refs/main holding the commit."""
    repo = root / ("models--" + repo_id.replace("/", "--"))
    (repo / "blobs").mkdir(parents=True)
    snap = repo / "snapshots" / commit
    snap.mkdir(parents=True)
    for f in sorted(source.iterdir()):
        if f.is_file():
            digest = hashlib.sha256(f.read_bytes()).hexdigest()
            shutil.copyfile(f, repo / "blobs" / digest)
            (snap / f.name).symlink_to(Path("..", "..", "blobs", digest))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    return root
