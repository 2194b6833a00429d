"""``diffulex chat``: an interactive conversation with a model, each answer shown while it is denoised.

The whole conversation is the prompt of every turn (rendered with the model's chat template, see
`diffulex.prompts`), so the model sees what was said before. One line of input is one user message; ``/exit``,
``/quit`` or end of input (Ctrl-D) ends the session, ``/reset`` forgets the conversation, Ctrl-C stops the answer
being written. A turn the conversation has outgrown (``max_model_len``) is refused and not kept, with a hint to
``/reset``. On a terminal the blocks being refined are drawn live (`diffulex.terminal_view`); otherwise each
answer is written as plain text on its own line, so the session can be driven through a pipe.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from typing import Any, TextIO

from diffulex.outputs import Trajectory
from diffulex.prompts import Message, encode_prompt
from diffulex.sampling_params import SamplingParams
from diffulex.terminal_view import DIM, RESET, TerminalDenoiseView

EXIT_COMMANDS = ("/exit", "/quit")
RESET_COMMAND = "/reset"
USER_PROMPT = "you> "
ASSISTANT_PROMPT = "model> "
# Columns assumed when the terminal does not say.
FALLBACK_COLUMNS = 80


@dataclass
class ChatSession:
    """A conversation with one engine: the history so far and the settings every turn uses."""

    engine: Any
    sampling_params: SamplingParams
    system: str | None = None
    parse_special_tokens: bool = False
    history: list[Message] = field(init=False, default_factory=list)

    def __post_init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.history = [{"role": "system", "content": self.system}] if self.system else []

    def reset_would_help(self, text: str) -> bool:
        """Whether ``text`` would fit as the first turn (after the system message) though the conversation has
        turns: then a turn refused as too long is the conversation's length, and ``/reset`` lets it through."""
        fresh = [{"role": "system", "content": self.system}] if self.system else []
        if len(self.history) <= len(fresh):
            return False
        engine = self.engine
        try:
            ids = encode_prompt(
                engine.tokenizer, [*fresh, {"role": "user", "content": text}], mask_token_id=engine.mask_token_id,
                vocab_size=engine.vocab_limit, parse_special_tokens=self.parse_special_tokens,
                max_model_len=engine.config.max_model_len,
            )
        except ValueError:
            return False
        return len(ids) < engine.config.max_model_len

    def ask(self, text: str, out: TextIO, live: bool) -> Trajectory:
        """One turn: the answer to ``text`` given the history, written to ``out`` as it is denoised. The turn is
        kept in the history only once it is answered (a refused or interrupted turn leaves it as it was)."""
        engine = self.engine
        messages = [*self.history, {"role": "user", "content": text}]
        ids = encode_prompt(
            engine.tokenizer, messages, mask_token_id=engine.mask_token_id, vocab_size=engine.vocab_limit,
            parse_special_tokens=self.parse_special_tokens, max_model_len=engine.config.max_model_len,
        )
        req_id = engine.add_request(ids, self.sampling_params)
        view = TerminalDenoiseView(
            out, engine.tokenizer, mask_token_id=engine.mask_token_id, block_size=engine.settings.block_size,
            prompt_len=len(ids), max_tokens=self.sampling_params.max_tokens,
            stop_token_ids=engine.settings.stop_token_ids, live=live,
            columns=shutil.get_terminal_size((FALLBACK_COLUMNS, 24)).columns,
        )
        try:
            trajectory = _run_to_end(engine, req_id, view)
        except KeyboardInterrupt:
            engine.abort_request(req_id)
            view.finish(view.written)
            raise
        view.finish(trajectory.text)
        self.history = [*messages, {"role": "assistant", "content": trajectory.text}]
        return trajectory


def _run_to_end(engine: Any, req_id: int, view: TerminalDenoiseView) -> Trajectory:
    while True:
        for update in engine.step():
            if update.req_id != req_id:
                continue
            if update.finished:
                return update.trajectory
            view.update(update)


def run_chat(session: ChatSession, inp: TextIO, out: TextIO, err: TextIO) -> int:
    """Read user lines from ``inp`` until ``/exit`` or end of input; answer each on ``out``. Returns 0."""
    terminal = inp.isatty() and out.isatty()
    if terminal:
        out.write(f"{DIM}Chatting with {session.engine.config.model}. /exit or Ctrl-D to leave, /reset to start "
                  f"over, Ctrl-C to stop an answer.{RESET}\n")
    while True:
        if terminal:
            out.write(USER_PROMPT)
            out.flush()
        try:
            line = inp.readline()
        except KeyboardInterrupt:
            line = ""
        if not line:  # end of input (Ctrl-D)
            if terminal:
                out.write("\n")
            return 0
        text = line.strip()
        if not text:
            continue
        if text in EXIT_COMMANDS:
            return 0
        if text == RESET_COMMAND:
            session.reset()
            err.write("(the conversation is forgotten)\n")
            continue
        if terminal:
            out.write(ASSISTANT_PROMPT)
        try:
            trajectory = session.ask(text, out, live=terminal)
        except KeyboardInterrupt:
            err.write("(answer stopped)\n")
            continue
        except ValueError as error:  # a refused prompt (too long for the model, say): the session goes on
            if terminal:
                out.write("\n")
            message = str(error)
            if "max_model_len" in message and session.reset_would_help(text):
                message += (f"; the conversation so far no longer fits: type {RESET_COMMAND} to start over "
                            "(this message was not added to it)")
            err.write(f"error: {message}\n")
            continue
        if terminal:
            err.write(f"{DIM}[{trajectory.num_generated_tokens} tokens, {trajectory.nfe} forwards, "
                      f"{trajectory.completion_reason}]{RESET}\n")
