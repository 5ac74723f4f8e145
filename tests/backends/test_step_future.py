"""The pieces of a torch backend's launch() (async scheduling) on CPU tensors: input ids taken
from the step in flight land at the right token indices from the right sampled rows, and the
future gives back the sampled ids as a SamplerOutput."""
from __future__ import annotations

import torch

from deepinfer.backends.torch.step_future import DeviceTokens, fill_from_last_step
from deepinfer.core.batch import InputsFromLastStep
from deepinfer.core.transfer import tensor_on


def test_ids_from_the_step_in_flight_go_where_the_batch_says():
    last = DeviceTokens(torch.tensor([70, 80, 90]))
    ids = torch.tensor([1, 0, 2, 0, 0])
    fill_from_last_step(ids, InputsFromLastStep([1, 3, 4], [2, 0, 1], last))
    assert ids.tolist() == [1, 90, 2, 70, 80]


def test_no_ids_from_the_last_step_leaves_the_inputs_alone():
    ids = torch.tensor([4, 5, 6])
    fill_from_last_step(ids, None)
    assert ids.tolist() == [4, 5, 6]


def test_a_future_reads_back_its_tokens():
    future = DeviceTokens(torch.tensor([3, 1, 4]))
    assert not future.read and future.event is None  # no stream event off the GPU
    out = future.result()
    assert out.token_ids == [3, 1, 4] and out.logprobs == [None] * 3
    assert future.read


def test_tensor_on_keeps_values_and_dtype():
    t = tensor_on([[1, 2], [3, 4]], "cpu")
    assert t.dtype == torch.long and t.tolist() == [[1, 2], [3, 4]]
    f = tensor_on([0.5, 2.0], torch.device("cpu"), torch.float32)
    assert f.dtype == torch.float32 and f.tolist() == [0.5, 2.0]
