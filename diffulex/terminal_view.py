"""One answer written to a terminal while it is denoised.

A diffusion model does not write left to right: it fills a block of masked positions in any order over several
steps. Text in committed blocks is final and is written once; the blocks still being refined are drawn after it,
masks included, and redrawn in place at every step (ANSI cursor movement), so the user sees each block sharpen.
Where the output is not a terminal only the final text is written, append-only and without escape codes.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Collection
from typing import TYPE_CHECKING, Any, TextIO

if TYPE_CHECKING:
    from diffulex.engine.request_update import RequestUpdate

MASK_GLYPH = "_"
NEWLINE_GLYPH = "\u21b5"  # a newline inside the live blocks, kept on one line so redrawing stays simple
REPLACEMENT_CHAR = "\ufffd"  # a decoded token that ends inside a UTF-8 character
DIM, BOLD, RESET = "\x1b[2m", "\x1b[1m", "\x1b[0m"
CLEAR_TO_END = "\x1b[J"


def display_width(text: str) -> int:
    """Columns the text takes in a terminal (wide East Asian characters take two, combining marks none)."""
    width = 0
    for char in text:
        if unicodedata.combining(char):
            continue
        width += 2 if unicodedata.east_asian_width(char) in ("W", "F") else 1
    return width


class TerminalDenoiseView:
    """Writes one request's answer to ``out`` from its step updates (`update`), then its final text (`finish`)."""

    def __init__(
        self,
        out: TextIO,
        tokenizer: Any,
        *,
        mask_token_id: int,
        block_size: int,
        prompt_len: int,
        max_tokens: int,
        stop_token_ids: Collection[int],
        live: bool,
        columns: int,
    ) -> None:
        self.out = out
        self.tokenizer = tokenizer
        self.mask_token_id = mask_token_id
        self.block_size = block_size
        self.prompt_len = prompt_len
        self.max_tokens = max_tokens
        self.stop_token_ids = frozenset(stop_token_ids)
        self.live = live
        self.columns = max(columns, 1)
        self.written = ""  # final text written so far
        self._column = 0  # cursor column after ``written``
        self._live_rows = 0  # rows below that column the live blocks reach (0: none drawn or on the same row)
        self._live_drawn = False

    # ----- final text -------------------------------------------------------------------------------------------

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _write_final(self, text: str) -> None:
        """Append final text (erasing the live blocks first)."""
        if not text:
            return
        self._erase_live()
        self.out.write(text)
        self.written += text
        last_line = text.rsplit("\n", 1)[-1]
        start = 0 if "\n" in text else self._column
        self._column = (start + display_width(last_line)) % self.columns

    def _committed_text(self, update: RequestUpdate) -> str:
        text = self._decode(update.committed_token_ids)
        return text.rstrip(REPLACEMENT_CHAR)  # the rest of that character comes with the next block

    # ----- live blocks ------------------------------------------------------------------------------------------

    def _live_text(self, update: RequestUpdate) -> str:
        """The running blocks after the committed text: decoded runs as text, each mask as `MASK_GLYPH`."""
        record = update.record
        if record is None or not record.running_block_ids:
            return ""
        start = record.running_start
        if start is None:
            start = record.running_block_ids[0] * self.block_size
        first = self.prompt_len + len(update.committed_token_ids)
        end = self.prompt_len + self.max_tokens
        pieces: list[str] = []
        run: list[int] = []
        for offset, token in enumerate(record.running_token_ids):
            position = start + offset
            if position < first:
                continue
            if position >= end or token in self.stop_token_ids:
                break
            if token == self.mask_token_id:
                if run:
                    pieces.append(self._decode(run))
                    run = []
                pieces.append(MASK_GLYPH)
            else:
                run.append(token)
        if run:
            pieces.append(self._decode(run))
        return "".join(pieces).replace("\n", NEWLINE_GLYPH)

    def _erase_live(self) -> None:
        if not self._live_drawn:
            return
        moves = f"\x1b[{self._live_rows}A" if self._live_rows else ""
        moves += "\r" + (f"\x1b[{self._column}C" if self._column else "")
        self.out.write(moves + CLEAR_TO_END)
        self._live_drawn = False
        self._live_rows = 0

    def _draw_live(self, text: str) -> None:
        self._erase_live()
        if not text:
            return
        styled = "".join(f"{DIM}{c}{RESET}" if c == MASK_GLYPH else c for c in text)
        self.out.write(f"{BOLD}{styled}{RESET}")
        # A line filled to the last column leaves the cursor there (the wrap is deferred): count it on that row.
        self._live_rows = (self._column + display_width(text) - 1) // self.columns
        self._live_drawn = True

    # ----- what the caller drives -------------------------------------------------------------------------------

    def update(self, update: RequestUpdate) -> None:
        """Show one step: new final text, then (on a terminal) the blocks still being refined."""
        committed = self._committed_text(update)
        if committed.startswith(self.written):
            self._write_final(committed[len(self.written) :])
        if self.live:
            self._draw_live(self._live_text(update))
        self.out.flush()

    def finish(self, text: str) -> None:
        """The request's final answer: whatever of it is not written yet, and the end of the line."""
        self._erase_live()
        if text.startswith(self.written):
            self._write_final(text[len(self.written) :])
        self.out.write("\n")
        self.out.flush()
