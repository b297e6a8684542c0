"""DataProto: construction, indexing, union, chunk/concat, repeat, padding and transfer."""
import pickle

import pytest
import torch

from megaflow.protocol import LOSS_WEIGHT_KEYS, STANDARD_FIELDS, DataProto


def make(n=6, resp=3):
    g = torch.Generator().manual_seed(0)
    return DataProto.from_dict(
        tensors={
            "input_ids": torch.arange(n * 4).view(n, 4),
            "response_mask": torch.ones(n, resp, dtype=torch.long),
            "old_log_probs": torch.randn(n, resp, generator=g),
        },
        non_tensors={"uid": [f"u{i // 2}" for i in range(n)], "ground_truth": [[i, i + 1] for i in range(n)]},
        meta_info={"temperature": 1.0},
    )


def test_from_dict_and_len_and_standard_fields_documented():
    d = make()
    assert len(d) == 6
    assert d.non_tensor_batch["uid"].dtype == object
    # nested lists stay one object per row (no numpy broadcasting into a 2-D array)
    assert d.non_tensor_batch["ground_truth"].shape == (6,)
    assert d.non_tensor_batch["ground_truth"][2] == [2, 3]
    for name in ("input_ids", "responses", "response_mask", "old_log_probs", "ref_log_probs", "values",
                 "token_level_scores", "token_level_rewards", "advantages", "returns", "uid"):
        assert name in STANDARD_FIELDS
    assert "response_mask" in LOSS_WEIGHT_KEYS


def test_length_mismatch_errors_name_the_field():
    with pytest.raises(ValueError, match="disagree"):
        DataProto.from_dict({"a": torch.zeros(3), "b": torch.zeros(4)})
    with pytest.raises(ValueError, match="'uid' has 2 rows but the batch has 3"):
        DataProto.from_dict({"a": torch.zeros(3)}, {"uid": ["x", "y"]})
    with pytest.raises(TypeError, match="'a' must be a torch.Tensor"):
        DataProto.from_dict({"a": [1, 2, 3]})


def test_indexing_int_slice_tensor_bool():
    d = make()
    assert torch.equal(d[2].batch["input_ids"], torch.tensor([[8, 9, 10, 11]]))
    assert d[-1].non_tensor_batch["uid"].tolist() == ["u2"]
    s = d[1:4]
    assert len(s) == 3 and s.non_tensor_batch["uid"].tolist() == ["u0", "u1", "u1"]
    idx = d[torch.tensor([5, 0])]
    assert idx.batch["input_ids"][:, 0].tolist() == [20, 0]
    assert idx.non_tensor_batch["ground_truth"].tolist() == [[5, 6], [0, 1]]
    mask = torch.tensor([True, False, True, False, False, True])
    m = d[mask]
    assert m.batch["input_ids"][:, 0].tolist() == [0, 8, 20]
    assert m.non_tensor_batch["uid"].tolist() == ["u0", "u1", "u2"]
    with pytest.raises(IndexError):
        d[torch.tensor([True, False])]
    with pytest.raises(IndexError):
        d[6]
    with pytest.raises(TypeError, match="indexed by position"):
        d["uid"]


def test_select_pop_unknown_field():
    d = make()
    s = d.select(batch_keys=["input_ids"], non_tensor_keys=["uid"])
    assert s.keys() == ["input_ids", "uid"]
    with pytest.raises(KeyError, match="unknown tensor field.*'nope'"):
        d.select(batch_keys=["nope"])
    with pytest.raises(KeyError, match="unknown non-tensor field"):
        d.select(non_tensor_keys=["nope"])
    popped = d.pop(batch_keys=["old_log_probs"])
    assert "old_log_probs" not in d and "old_log_probs" in popped


def test_tensors_is_the_batch_or_a_key_error():
    ids = torch.arange(6).reshape(3, 2)
    dp = DataProto.from_dict({"input_ids": ids}, {"uid": ["a", "b", "c"]})
    assert dp.tensors is dp.batch and torch.equal(dp.tensors["input_ids"], ids)
    dp.tensors["responses"] = ids + 1  # a write goes to the batch
    assert torch.equal(dp.batch["responses"], ids + 1)
    objects_only = DataProto.from_dict(non_tensors={"uid": ["a", "b"]})
    with pytest.raises(KeyError, match=r"no tensor fields \(non-tensor fields: \['uid'\]\)"):
        objects_only.tensors


def test_union_merges_and_refuses_conflicts():
    d = make()
    extra = DataProto.from_dict({"values": torch.ones(6, 3)}, {"data_source": ["gsm8k"] * 6}, {"step": 3})
    u = d.union(extra)
    assert set(u.keys()) >= {"input_ids", "values", "uid", "data_source"}
    assert u.meta_info == {"temperature": 1.0, "step": 3}
    same = d.select(batch_keys=["input_ids"], non_tensor_keys=["uid"])
    assert len(d.union(same)) == 6  # identical shared fields are fine
    bad = DataProto.from_dict({"input_ids": torch.zeros(6, 4, dtype=torch.long)})
    with pytest.raises(ValueError, match="'input_ids'"):
        d.union(bad)
    bad_nt = DataProto.from_dict(non_tensors={"uid": ["z"] * 6})
    with pytest.raises(ValueError, match="'uid'"):
        d.union(bad_nt)
    with pytest.raises(ValueError, match="meta_info\\['temperature'\\]"):
        d.union(DataProto.from_dict({"x": torch.zeros(6)}, meta_info={"temperature": 0.5}))
    with pytest.raises(ValueError, match="6 and 2 rows"):
        d.union(DataProto.from_dict({"x": torch.zeros(2)}))


def test_chunk_concat_round_trip_and_errors():
    d = make()
    parts = d.chunk(3)
    assert [len(p) for p in parts] == [2, 2, 2]
    assert parts[1].non_tensor_batch["uid"].tolist() == ["u1", "u1"]
    back = DataProto.concat(parts)
    assert torch.equal(back.batch["old_log_probs"], d.batch["old_log_probs"])
    assert back.non_tensor_batch["ground_truth"].tolist() == d.non_tensor_batch["ground_truth"].tolist()
    with pytest.raises(ValueError, match="cannot chunk 6 rows into 4.*pad_to_divisor"):
        d.chunk(4)
    with pytest.raises(ValueError, match="piece 1 has fields"):
        DataProto.concat([d, d.select(batch_keys=["input_ids"])])
    assert [len(p) for p in d.split(4)] == [4, 2]


def test_repeat_interleave_and_tile():
    d = make(n=2)
    r = d.repeat(3, interleave=True)
    assert r.batch["input_ids"][:, 0].tolist() == [0, 0, 0, 4, 4, 4]
    assert r.non_tensor_batch["ground_truth"].tolist() == [[0, 1]] * 3 + [[1, 2]] * 3
    t = d.repeat(2, interleave=False)
    assert t.batch["input_ids"][:, 0].tolist() == [0, 4, 0, 4]
    assert t.non_tensor_batch["uid"].tolist() == ["u0", "u0", "u0", "u0"]


@pytest.mark.parametrize("n,k", [(6, 4), (5, 2), (3, 8), (8, 4)])
def test_pad_unpad_round_trip(n, k):
    d = make(n=n)
    padded, pad = d.pad_to_divisor(k)
    assert len(padded) % k == 0 and pad == (-n) % k
    # padded rows copy real rows but carry zero loss weight
    assert torch.equal(padded.batch["input_ids"][n:], d.batch["input_ids"][torch.arange(pad) % n])
    assert padded.batch["response_mask"][n:].sum() == 0
    assert padded.batch["response_mask"][:n].sum() == n * 3
    back = padded.unpad(pad)
    assert torch.equal(back.batch["input_ids"], d.batch["input_ids"])
    assert back.non_tensor_batch["uid"].tolist() == d.non_tensor_batch["uid"].tolist()


def test_pickle_moves_tensors_out_of_band_and_keeps_dtypes():
    d = make()
    d.batch["bf"] = torch.randn(6, 2).to(torch.bfloat16)
    buffers = []
    payload = pickle.dumps(d, protocol=5, buffer_callback=buffers.append)
    # each tensor field is one out-of-band buffer; the in-band stream stays small
    assert len(buffers) == len(d.batch.keys())
    assert len(payload) < 2000
    back = pickle.loads(payload, buffers=buffers)
    for k in d.batch.keys():
        assert back.batch[k].dtype == d.batch[k].dtype
        assert torch.equal(back.batch[k], d.batch[k])
    assert back.non_tensor_batch["uid"].tolist() == d.non_tensor_batch["uid"].tolist()


@pytest.mark.slow
def test_ray_round_trip_preserves_values(ray_session):
    import ray

    d = make()
    d.batch["bf"] = torch.randn(6, 2).to(torch.bfloat16)

    @ray.remote(num_cpus=0)
    def double(x: DataProto) -> DataProto:
        x.batch["old_log_probs"] *= 2  # writable after transfer
        return x

    out = ray.get(double.remote(d))
    assert torch.equal(out.batch["old_log_probs"], d.batch["old_log_probs"] * 2)
    assert torch.equal(out.batch["bf"], d.batch["bf"]) and out.batch["bf"].dtype == torch.bfloat16
    assert out.non_tensor_batch["ground_truth"].tolist() == d.non_tensor_batch["ground_truth"].tolist()
    assert out.meta_info == d.meta_info
