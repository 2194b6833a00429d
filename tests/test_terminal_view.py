"""The live denoising view: blocks are redrawn in place while they are refined, and the terminal ends up showing
exactly the final answer; off a terminal only the final text is written, without escape codes."""

from __future__ import annotations

import io
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from diffulex import Diffulex, SamplingParams
from diffulex.terminal_view import MASK_GLYPH, TerminalDenoiseView, display_width

ESCAPE = re.compile(r"\x1b\[(\d*)([A-Za-z])")


def screen_after(output: str, columns: int) -> list[str]:
    """What a terminal of ``columns`` columns shows after ``output`` (cursor moves, clears, deferred wrapping)."""
    rows: list[list[str]] = [[]]
    row = column = 0
    pending_wrap = False
    i = 0
    while i < len(output):
        match = ESCAPE.match(output, i)
        if match:
            count, command = int(match.group(1) or 1), match.group(2)
            if command == "A":
                row, pending_wrap = max(row - count, 0), False
            elif command == "C":
                column, pending_wrap = min(column + count, columns - 1), False
            elif command == "J":
                rows[row] = rows[row][:column]
                del rows[row + 1 :]
            i = match.end()
            continue
        char = output[i]
        i += 1
        if char == "\r":
            column, pending_wrap = 0, False
            continue
        if char == "\n" or pending_wrap:
            row, column, pending_wrap = row + 1, 0, False
            while len(rows) <= row:
                rows.append([])
            if char == "\n":
                continue
        line = rows[row]
        line.extend(" " * (column + 1 - len(line)))
        line[column] = char
        if column == columns - 1:
            pending_wrap = True
        else:
            column += 1
    shown = ["".join(r).rstrip() for r in rows]
    while shown and not shown[-1]:
        shown.pop()
    return shown


def wrapped(text: str, columns: int) -> list[str]:
    lines = []
    for line in text.split("\n"):
        lines += [line[i : i + columns] for i in range(0, max(len(line), 1), columns)]
    return [line.rstrip() for line in lines]


@pytest.fixture(scope="module")
def llm(sdar_dir: Path):
    with Diffulex(str(sdar_dir), block_size=4, buffer_size=2, max_model_len=128, num_pages=64) as engine:
        yield engine


def show_answer(llm, prompt: str, live: bool, columns: int, max_tokens: int = 12) -> tuple[str, str]:
    """Drive one request through the engine into a view; returns (what the view wrote, the final answer)."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    ids = llm.tokenizer.encode(prompt, add_special_tokens=False)
    req_id = llm.add_request(ids, params)
    out = io.StringIO()
    view = TerminalDenoiseView(
        out, llm.tokenizer, mask_token_id=llm.mask_token_id, block_size=4, prompt_len=len(ids),
        max_tokens=max_tokens, stop_token_ids=llm.settings.stop_token_ids, live=live, columns=columns,
    )
    while True:
        for update in llm.step():
            if update.req_id != req_id:
                continue
            if update.finished:
                view.finish(update.trajectory.text)
                return out.getvalue(), update.trajectory.text
            view.update(update)


@pytest.mark.parametrize("columns", [80, 7, 3])
def test_the_terminal_ends_up_showing_exactly_the_answer(llm, columns) -> None:
    written, answer = show_answer(llm, "The old lighthouse", live=True, columns=columns)
    assert f"{MASK_GLYPH}" in written and "\x1b[" in written  # masks were drawn, then redrawn in place
    assert screen_after(written, columns) == [line for line in wrapped(answer, columns)]


def test_the_answer_grows_in_place_while_it_is_denoised(llm) -> None:
    written, answer = show_answer(llm, "One, two, three", live=True, columns=80, max_tokens=16)
    redraws = written.count("\x1b[J")
    assert redraws >= 4  # one redraw per step at least, the flat model accepts about one token per step
    assert answer.split("\n")[0] in screen_after(written, 80)[0]


def test_off_a_terminal_only_the_final_text_is_written(llm) -> None:
    written, answer = show_answer(llm, "The old lighthouse", live=False, columns=80)
    assert "\x1b" not in written and MASK_GLYPH not in written.replace(answer, "")
    assert written == answer + "\n"


def test_display_width_counts_wide_characters_twice() -> None:
    assert display_width("abc") == 3
    assert display_width("你好") == 4
    assert display_width("e\u0301") == 1  # a combining accent takes no column


def scripted_update(committed: list[int], start_block: int, running: list[int]) -> SimpleNamespace:
    """What the view reads of a `RequestUpdate`: the committed answer ids and the step's running blocks."""
    record = SimpleNamespace(running_block_ids=(start_block,), running_token_ids=tuple(running), running_start=None)
    return SimpleNamespace(committed_token_ids=committed, record=record)


def test_live_blocks_longer_than_the_answer_leave_nothing_behind(llm) -> None:
    tok, mask = llm.tokenizer, llm.mask_token_id
    words = tok.encode(" one two three four five six seven eight", add_special_tokens=False)[:8]
    first_block = tok.decode(words[:4])
    prompt_len, columns = 4, 10  # the answer starts at position 4: block 1 of size 4
    out = io.StringIO()
    view = TerminalDenoiseView(out, tok, mask_token_id=mask, block_size=4, prompt_len=prompt_len, max_tokens=8,
                               stop_token_ids=llm.settings.stop_token_ids, live=True, columns=columns)
    view.update(scripted_update([], 1, [mask] * 8))
    assert screen_after(out.getvalue(), columns) == [MASK_GLYPH * 8]
    view.update(scripted_update([], 1, words[:2] + [mask] * 6))
    assert screen_after(out.getvalue(), columns) == wrapped(tok.decode(words[:2]) + MASK_GLYPH * 6, columns)
    view.update(scripted_update(words[:4], 2, words[4:7] + [mask]))
    live = first_block + tok.decode(words[4:7]) + MASK_GLYPH
    assert screen_after(out.getvalue(), columns) == wrapped(live, columns)
    view.finish(first_block)  # the request ended after the first block: the live second block goes
    assert screen_after(out.getvalue(), columns) == wrapped(first_block, columns)
