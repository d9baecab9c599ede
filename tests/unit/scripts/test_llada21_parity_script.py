"""scripts/check_llada21_parity.py's pieces that do not need the published file: importing a
Hugging Face folder as a package, reading and correcting the attention mask, cutting outputs,
and bounding a published loop that does not end."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

SCRIPTS = Path(__file__).resolve().parents[3] / "scripts"


@pytest.fixture(scope="module")
def script():
    sys.path.insert(0, str(SCRIPTS))
    try:
        import check_llada21_parity
    finally:
        sys.path.remove(str(SCRIPTS))
    return check_llada21_parity


def test_a_folder_without_init_imports_with_its_relative_import(script, tmp_path):
    (tmp_path / "configuration_llada2_moe.py").write_text("SIZE = 41\n")
    (tmp_path / "modeling_llada2_moe.py").write_text("from .configuration_llada2_moe import SIZE\nNEXT = SIZE + 1\n")
    assert script.import_folder(tmp_path, "parity_test_pkg").NEXT == 42
    (tmp_path / "configuration_llada2_moe.py").write_text("SIZE = 1\n")  # a second import reads the folder again
    assert script.import_folder(tmp_path, "parity_test_pkg").NEXT == 2


def _seen(script, mask: torch.Tensor, intended: bool):
    """The kinds MaskSeen records for `mask` and the mask the wrapped attention receives."""
    got = []
    seen = script.MaskSeen(lambda m, q, k, v, mask, *a, **kw: got.append(mask) or "out", intended)
    assert seen(None, "q", "k", "v", mask) == "out"
    return seen.kinds, got[0]


def test_a_zero_one_mask_is_recorded_and_converted_only_when_intended(script):
    zero_one = torch.tril(torch.ones(4, 4))
    kinds, passed = _seen(script, zero_one, intended=False)
    assert kinds == {"0/1"} and passed is zero_one
    kinds, passed = _seen(script, zero_one, intended=True)
    assert kinds == {"0/1"}
    assert torch.equal(passed, torch.zeros(4, 4).masked_fill(zero_one == 0, float("-inf")))


@pytest.mark.parametrize("mask", [torch.zeros(3, 3), torch.zeros(3, 3).masked_fill(torch.ones(3, 3).triu(1).bool(),
                                                                                     float("-inf"))])
def test_an_additive_mask_passes_unchanged(script, mask):
    """All zeros (everything visible) is additive too: it must not be read as 0/1 and turned into -inf."""
    kinds, passed = _seen(script, mask, intended=True)
    assert kinds == {"0/-inf"} and passed is mask


def test_cut_stops_at_eos_or_mask_and_at_the_generation_length(script):
    assert script.cut([5, 6, script.EOS_ID, 7], script.G) == [5, 6]
    assert script.cut([5, script.MASK_ID, 7], script.G) == [5]
    assert script.cut(list(range(100, 140)), script.G) == list(range(100, 100 + script.G))


def test_watch_bounds_forwards_and_notes_the_mask_token_picked_for_a_mask(script):
    class Model:
        def forward(self, input_ids, attention_mask=None):
            return input_ids

        def _sample_with_temperature_topk_topp(self, logits):
            return logits.argmax(-1), logits.amax(-1)

    model, mask = Model(), 3
    watch = script.Watch(model, mask_id=mask, limit=3)
    picks = torch.eye(4)[[0, 3]][None]  # (1, 2, V): the block's second position picks the mask token
    model.forward(torch.tensor([[9, 9, 5, 6]]))  # the window's last block (2 wide) holds no mask
    model._sample_with_temperature_topk_topp(picks)
    assert not watch.picked_mask  # an edit to the mask token: Celeris does that too
    model.forward(torch.tensor([[9, 9, 5, mask]]), attention_mask=None)
    model._sample_with_temperature_topk_topp(picks)
    assert watch.picked_mask
    model.forward(torch.tensor([[1]]))
    with pytest.raises(script.NoEnd):
        model.forward(torch.tensor([[1]]))
    watch.reset()
    assert (watch.forwards, watch.picked_mask) == (0, False)
    model.forward(torch.tensor([[1]]))
