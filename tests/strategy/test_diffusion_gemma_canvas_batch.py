"""The batched canvas rule (`diffulex.strategy.diffusion_gemma.canvas.denoise_canvases`) against the rule written
for one canvas (`diffulex.testing.diffusion_gemma_canvas_reference.denoise_canvas`): the same tokens, argmaxes,
ends, mean entropies, histories and self-conditioning inputs for canvases of different temperatures (0 among them),
seeds and steps in one group, some ending early, on every device at hand: bit for bit on the CPU; on a GPU, whose
sampled canvases take the fused sampling kernels, the entropies and self-conditioning inputs within float32
rounding. On every device a canvas steps in a group bit for bit as in a group of its own."""

from __future__ import annotations

import pytest
import torch

from diffulex.strategy.diffusion_gemma.canvas import (
    CanvasSchedule,
    CanvasState,
    denoise_canvases,
    draw_categorical,
    fresh_state,
)
from diffulex.testing.diffusion_gemma_canvas_reference import denoise_canvas

DEVICES = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]
CANVAS, VOCAB, LIMIT, HIDDEN = 16, 50, 45, 8
SCHEDULE = CanvasSchedule(max_steps=6, stability_threshold=2, confidence_threshold=0.5, t_min=0.4, t_max=0.8,
                          entropy_bound=0.3)  # fmt: skip
# canvas -> (request temperature, seed, logits that settle): canvas b joins the group at step b % 3
CANVASES = [(0.0, 11, True), (1.0, 12, False), (0.5, 13, True), (1.7, 14, False), (0.0, 15, False), (1.0, 12, False)]


class Embeddings:
    """Stand-ins for the model's self-conditioning: a softmax times a matrix, and the rows of one-hot tokens."""

    def __init__(self, device: torch.device) -> None:
        self.matrix = torch.randn(VOCAB, HIDDEN, generator=torch.Generator().manual_seed(3)).to(device)

    def soft(self, logits: torch.Tensor) -> torch.Tensor:
        return torch.softmax(logits, dim=-1) @ self.matrix

    def soft_of_probs(self, probs: torch.Tensor) -> torch.Tensor:
        """`soft` from the probabilities (the batched rule's interface; float32 here, the matrix's dtype)."""
        return probs @ self.matrix

    def one_hot(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.matrix[tokens] * 2.0


def step_logits(canvas: int, step: int, settles: bool, device: torch.device) -> torch.Tensor:
    """Random logits; a settling canvas's have one sharp peak per position, the same at every step (its argmax
    repeats and its entropy is near 0), and every canvas's padding ids would win were they not banned."""
    logits = torch.randn(CANVAS, VOCAB, generator=torch.Generator().manual_seed(100 * canvas + step)) * 2
    if settles:
        logits[torch.arange(CANVAS), (torch.arange(CANVAS) * 7 + canvas) % LIMIT] = 40.0
    logits[:, LIMIT:] += 60.0
    return logits.to(device)


def assert_same_step(got, want, exact: bool = True) -> None:
    """Equal steps; without ``exact`` (the fused sampling kernels against PyTorch) the mean entropy and the
    self-conditioning input within float32 rounding."""
    assert torch.equal(got.argmax, want.argmax)
    assert got.finished == want.finished
    if exact:
        assert got.mean_entropy == want.mean_entropy  # the same float32, read on the host
    else:
        assert got.mean_entropy == pytest.approx(want.mean_entropy, rel=1e-5, abs=1e-6)
    assert torch.equal(got.state.tokens, want.state.tokens)
    assert got.state.steps == want.state.steps and got.state.index == want.state.index
    assert len(got.state.history) == len(want.state.history)
    assert all(torch.equal(a, b) for a, b in zip(got.state.history, want.state.history, strict=True))
    assert (got.state.soft_embeds is None) == (want.state.soft_embeds is None)
    if want.state.soft_embeds is not None:
        if exact:
            assert torch.equal(got.state.soft_embeds, want.state.soft_embeds)
        else:
            torch.testing.assert_close(got.state.soft_embeds, want.state.soft_embeds, rtol=1e-5, atol=1e-5)


def batched(logits, states, temperatures, seeds, embeddings):
    return denoise_canvases(logits, states, temperatures, seeds, SCHEDULE, LIMIT, embeddings.soft_of_probs,
                            embeddings.one_hot, torch.float32)  # fmt: skip


@pytest.mark.parametrize("device", DEVICES)
def test_a_group_of_canvases_steps_as_each_canvas_does_alone(device: str) -> None:
    """Six canvases join a group at different steps (so its members are at different steps, with histories of
    different lengths); greedy and sampled ones settle early beside ones that run the whole schedule; each group
    step equals the one-canvas rule on each member's own logits, and the group goes on from the batched states."""
    dev = torch.device(device)
    embeddings = Embeddings(dev)
    states: dict[int, CanvasState] = {}
    ended_at: dict[int, int] = {}
    mixed_histories = False
    for t in range(SCHEDULE.max_steps + 3):
        for b in range(len(CANVASES)):
            if b % 3 == t:
                states[b] = fresh_state(CANVASES[b][1], b % 2, CANVAS, LIMIT, dev)
        members = [b for b in sorted(states) if b not in ended_at]
        if not members:
            break
        logits = torch.stack([step_logits(b, states[b].steps, CANVASES[b][2], dev) for b in members])
        mixed_histories |= len({len(states[b].history) for b in members}) > 1
        group = batched(logits.clone(), [states[b] for b in members], [CANVASES[b][0] for b in members],
                        [CANVASES[b][1] for b in members], embeddings)  # fmt: skip
        settled, means = group.settled.tolist(), group.mean_entropy.tolist()
        for i, b in enumerate(members):
            got = group.resolve(i, settled[i], means[i])
            want = denoise_canvas(logits[i].clone(), states[b], SCHEDULE, CANVASES[b][0], LIMIT, CANVASES[b][1],
                                  embeddings.soft, embeddings.one_hot)  # fmt: skip
            assert_same_step(got, want, exact=dev.type == "cpu")
            alone = batched(logits[i : i + 1].clone(), [states[b]], [CANVASES[b][0]], [CANVASES[b][1]], embeddings)
            assert_same_step(alone.resolve(0, bool(alone.settled[0]), float(alone.mean_entropy[0])), got)
            assert int(got.state.tokens.max()) < LIMIT
            states[b] = got.state
            if got.finished:
                ended_at[b] = got.state.steps
    assert mixed_histories
    assert sorted(ended_at) == list(range(len(CANVASES)))
    early = {b for b, steps in ended_at.items() if steps < SCHEDULE.max_steps}
    assert early == {b for b, (_, _, settles) in enumerate(CANVASES) if settles}


@pytest.mark.parametrize("device", DEVICES)
def test_a_draw_is_multinomials_draw_and_leaves_the_generator_where_it_does(device: str) -> None:
    """`draw_categorical` gives `torch.multinomial`'s single draw per row from the same generator, and the next
    numbers that generator gives (the re-noising tokens) are the same too."""
    dev = torch.device(device)
    probs = torch.softmax(torch.randn(CANVAS, VOCAB, generator=torch.Generator().manual_seed(5)) * 3, -1).to(dev)
    probs[:, LIMIT:] = 0.0
    for seed in range(4):
        ours = torch.Generator(device=dev).manual_seed(seed)
        theirs = torch.Generator(device=dev).manual_seed(seed)
        drawn = draw_categorical(probs, ours)
        assert torch.equal(drawn, torch.multinomial(probs, 1, generator=theirs).squeeze(-1))
        assert int(drawn.max()) < LIMIT
        after = torch.randint(0, LIMIT, (CANVAS,), generator=ours, device=dev)
        assert torch.equal(after, torch.randint(0, LIMIT, (CANVAS,), generator=theirs, device=dev))


@pytest.mark.parametrize("device", DEVICES)
def test_a_canvas_without_a_distribution_shows_alone(device: str) -> None:
    """Non-finite logits in one sampled canvas (where `torch.multinomial` refuses to draw) clear its `drawable`
    flag, which its request fails by; the canvas beside it keeps the flag and steps as it does alone."""
    dev = torch.device(device)
    embeddings = Embeddings(dev)
    logits = torch.stack([step_logits(1, 0, False, dev), step_logits(3, 0, False, dev)])
    logits[0, 2, 4] = float("nan")
    states = [fresh_state(1, 0, CANVAS, LIMIT, dev), fresh_state(3, 0, CANVAS, LIMIT, dev)]
    group = batched(logits.clone(), states, [1.0, 1.0], [1, 3], embeddings)
    assert group.drawable.tolist() == [False, True]
    if dev.type == "cpu":  # on a GPU multinomial's check is a device-side assert, which would end the CUDA context
        with pytest.raises(RuntimeError, match="probability tensor contains"):
            denoise_canvas(logits[0].clone(), states[0], SCHEDULE, 1.0, LIMIT, 1, embeddings.soft, embeddings.one_hot)
    want = denoise_canvas(logits[1].clone(), states[1], SCHEDULE, 1.0, LIMIT, 3, embeddings.soft, embeddings.one_hot)
    assert_same_step(group.resolve(1, bool(group.settled[1]), float(group.mean_entropy[1])), want, dev.type == "cpu")

