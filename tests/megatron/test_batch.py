"""left_align_batch: left alignment, response indices and validation errors (no processes)."""
from __future__ import annotations

import pytest
import torch

from megaflow.megatron.batch import OLD_ROUTED_EXPERTS_KEY, left_align_batch, unalign_positions
from megatron_testlib import make_batch


def _slow_left_align(batch):
    """Per-row loop reference: real tokens moved left; index of logits predicting response t."""
    ids, mask = batch["input_ids"], batch["attention_mask"]
    seq, resp_len = ids.shape[1], batch["responses"].shape[1]
    rows, indices = [], []
    for b in range(len(ids)):
        real = [int(ids[b, j]) for j in range(seq) if mask[b, j]]
        first = next(j for j in range(seq) if mask[b, j])
        rows.append(real)
        indices.append([seq - resp_len + r - 1 - first for r in range(resp_len)])
    return rows, indices


def test_left_alignment_matches_loop_reference():
    batch = make_batch(3, batch=5, prompt_len=6, response_len=5)
    aligned = left_align_batch(batch, max_seq_len=64, vocab_size=200)
    rows, indices = _slow_left_align(batch)
    assert aligned.seq_len == max(len(r) for r in rows)
    for b, real in enumerate(rows):
        assert aligned.input_ids[b, : len(real)].tolist() == real
        assert torch.all(aligned.input_ids[b, len(real):] == 0)
        resp_valid = batch["attention_mask"][b, -5:].bool()
        assert aligned.response_valid[b].tolist() == resp_valid.tolist()
        for r in range(5):
            if resp_valid[r]:  # the logits at that index predict the response token
                i = indices[b][r]
                assert aligned.response_index[b, r] == i
                assert aligned.input_ids[b, i + 1] == batch["responses"][b, r]
    assert set(aligned.fields) == {"response_mask"}


def test_pad_rows_zeroes_loss_masks():
    aligned = left_align_batch(make_batch(0, batch=3), max_seq_len=64)
    padded, num_pad = aligned.pad_rows(4, zero_keys=("response_mask",))
    assert num_pad == 1 and padded.num_rows == 4
    assert torch.equal(padded.input_ids[3], aligned.input_ids[0])
    assert padded.fields["response_mask"][3].sum() == 0
    assert aligned.pad_rows(3)[1] == 0


@pytest.mark.parametrize("width_multiple", [1, 4])
def test_take_gives_the_alignment_of_the_rows_on_their_own(width_multiple):
    batch = make_batch(5, batch=8, prompt_len=7, response_len=6)
    batch["advantages"] = torch.randn(8, 6, generator=torch.Generator().manual_seed(1))
    whole = left_align_batch(batch, max_seq_len=64, width_multiple=width_multiple)
    for index in (torch.tensor([3, 6, 1]), torch.tensor([5, 2]), torch.arange(1, 8)):  # row 0 (the longest) left out
        alone = left_align_batch({k: v[index] for k, v in batch.items()}, max_seq_len=64,
                                 width_multiple=width_multiple)
        taken = whole.take(index)
        assert taken.seq_len < whole.seq_len or width_multiple > 1
        assert taken.seq_len == alone.seq_len and taken.seq_len % width_multiple == 0
        for name in ("input_ids", "lengths", "response_index", "response_valid"):
            assert torch.equal(getattr(taken, name), getattr(alone, name)), name
        assert taken.fields.keys() == alone.fields.keys()
        assert all(torch.equal(taken.fields[k], alone.fields[k]) for k in alone.fields)


def _broken(change):
    batch = make_batch(0, batch=3)
    change(batch)
    return batch


@pytest.mark.parametrize("change, message", [
    (lambda b: b.pop("responses"), "missing \\['responses'\\]"),
    (lambda b: b.update(attention_mask=b["attention_mask"][:, 1:]), "attention_mask"),
    (lambda b: b.update(responses=b["input_ids"]), "responses"),
    (lambda b: b.update(advantages=torch.zeros(2, 6)), "'advantages'"),
    (lambda b: b["attention_mask"].__setitem__((0, 9), 0), "contiguous"),
    (lambda b: b["attention_mask"].__setitem__((slice(None), slice(0, 7)), 0), "no prompt token"),
    (lambda b: b["attention_mask"].__setitem__((0, 0), 2), "only 0 and 1"),
    (lambda b: b["input_ids"].__setitem__((0, 3), 999), "outside \\[0, 200\\)"),
    (lambda b: b.update(responses=(b["responses"] + 1) % 200), "responses must equal"),
    (lambda b: b.update(position_ids=b["position_ids"] + 1), "position_ids"),
])
def test_invalid_batches_raise_clear_errors(change, message):
    with pytest.raises(ValueError, match=message):
        left_align_batch(_broken(change), max_seq_len=64, vocab_size=200)


def test_too_long_sequence_names_row_and_limit():
    with pytest.raises(ValueError, match="sequence 0 has 13 tokens.*max_seq_len=12"):
        left_align_batch(make_batch(0), max_seq_len=12)


def test_unalign_positions_inverts_the_left_alignment_of_a_position_field():
    """The routing the engine records in the aligned layout goes back to the verl layout: placed
    at each row's token positions by a loop, -1 elsewhere; aligning that again gives it back."""
    batch = make_batch(0)
    rows, seq = batch["input_ids"].shape
    aligned = left_align_batch(batch, max_seq_len=64)
    recorded = torch.randint(0, 4, (rows, aligned.seq_len + 2, 3, 2), generator=torch.Generator().manual_seed(0))
    out = unalign_positions(recorded, batch["attention_mask"], -1)
    expected = torch.full((rows, seq, 3, 2), -1, dtype=recorded.dtype)
    for i in range(rows):
        positions = batch["attention_mask"][i].nonzero().flatten().tolist()
        for j, p in enumerate(positions):
            expected[i, p] = recorded[i, j]
    assert torch.equal(out, expected)
    again = left_align_batch({**batch, OLD_ROUTED_EXPERTS_KEY: out}, max_seq_len=64)
    real = torch.arange(aligned.seq_len)[None] < aligned.lengths[:, None]
    assert torch.equal(again.fields[OLD_ROUTED_EXPERTS_KEY][real], recorded[:, : aligned.seq_len][real])
    with pytest.raises(ValueError, match="does not cover"):
        unalign_positions(recorded[:, :2], batch["attention_mask"], -1)
