"""What rank 0 of a tensor-parallel group tells its workers each step, and the channel that carries it.

Apart from the worker processes (`diffulex.engine.tensor_parallel`) because the model runner sends these messages
and the workers' loop builds whole engines: the runner must not import the module that assembles engines.
"""

from __future__ import annotations

import dataclasses
import enum
import pickle
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from diffulex.engine.cuda_graph import SampledRows
from diffulex.engine.step_inputs import StepInputs

# Bytes of the buffer one step's broadcast carries: the pickled message of a decode step of a few hundred requests
# fits; a longer one (a large prefill) sends its remainder in a second broadcast, sized by the first.
CHANNEL_CAPACITY = 1 << 18
LENGTH_BYTES = 8  # the message length, in front of it

class MessageKind(enum.Enum):
    EAGER = "eager"  # a step through the eager forward
    GRAPH = "graph"  # a step replayed from the decode graphs (staged in a host buffer)
    CONTINUATION = "continuation"  # the graphs replayed again on the inputs the last step advanced
    STATIC_DECODE = "static_decode"  # switch to the graphs' static decode buffers (`GraphPolicy`)
    RUNNER = "runner"  # a pass of a strategy's own runner (`Strategy.make_runner`): ``payload`` is that runner's
    STOP = "stop"  # leave the group and exit


@dataclass(frozen=True)
class StepMessage:
    """What rank 0 broadcasts for one step: everything the workers' runners need to repeat its device work."""

    kind: MessageKind
    step: StepInputs | None = None  # without its ``work`` (requests live on rank 0)
    bucket: int | None = None
    micro_batch: int = 0
    sampled: SampledRows | None = None
    num_rows: int = 0  # a continuation's sampled rows
    capture: bool = False  # STATIC_DECODE: capture CUDA graphs (else the uncaptured padded path)
    # GRAPH, CONTINUATION: which of the runner's decode-shaped graph sets the step replays
    # (`diffulex.engine.model_runner.GRAPH_SETS`: the decode graphs, the short, chunk or straggler graphs)
    graph_set: str = "decode"
    # GRAPH: the prefill graph replays before the decode graph's (`diffulex.engine.prefill_graphs`), each the step of
    # one request or a group of prompts and its bucket's rows, in order; with ``bucket`` None they are the whole step
    prefills: tuple[tuple[StepInputs, int], ...] = ()
    # RUNNER: what the strategy's runner tells its workers (its own message type, which its `follow_step` reads)
    payload: object = None

    @classmethod
    def of_step(
        cls,
        step: StepInputs,
        bucket: int | None,
        micro_batch: int,
        sampled: SampledRows | None,
        graph_set: str = "decode",
        prefills: Sequence[tuple[StepInputs, int]] = (),
    ) -> StepMessage:
        wire = dataclasses.replace(step, work=[])
        wire_prefills = tuple((dataclasses.replace(part, work=[]), rows) for part, rows in prefills)
        kind = MessageKind.GRAPH if bucket is not None or prefills else MessageKind.EAGER
        return cls(kind, wire, bucket, micro_batch, sampled, graph_set=graph_set, prefills=wire_prefills)


class StepChannel:
    """Rank 0 to the workers over a gloo group: one broadcast of a fixed-size byte buffer per message (a second
    one only for a message longer than the buffer)."""

    def __init__(self, group: dist.ProcessGroup, rank: int) -> None:
        self.group = group
        self.rank = rank
        self.buffer = torch.empty(CHANNEL_CAPACITY, dtype=torch.uint8)

    def send(self, message: StepMessage) -> None:
        payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        head = CHANNEL_CAPACITY - LENGTH_BYTES
        framed = len(payload).to_bytes(LENGTH_BYTES, "little") + payload[:head]
        self.buffer[: len(framed)] = torch.frombuffer(bytearray(framed), dtype=torch.uint8)
        dist.broadcast(self.buffer, src=0, group=self.group)
        if len(payload) > head:
            rest = torch.frombuffer(bytearray(payload[head:]), dtype=torch.uint8)
            dist.broadcast(rest, src=0, group=self.group)

    def receive(self) -> StepMessage:
        dist.broadcast(self.buffer, src=0, group=self.group)
        length = int.from_bytes(self.buffer[:LENGTH_BYTES].numpy().tobytes(), "little")
        head = CHANNEL_CAPACITY - LENGTH_BYTES
        payload = self.buffer[LENGTH_BYTES : LENGTH_BYTES + min(length, head)].numpy().tobytes()
        if length > head:
            rest = torch.empty(length - head, dtype=torch.uint8)
            dist.broadcast(rest, src=0, group=self.group)
            payload += rest.numpy().tobytes()
        return pickle.loads(payload)
