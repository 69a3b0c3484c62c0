"""A job's prompt builders: how a row becomes prompt text under the job's options (a plain
column, a template, chat messages through the tokenizer's chat template), and the two builders
of an OpenAI batch file, whose lines may mix completions and chat."""

from __future__ import annotations

from batchgen.data import PromptBuilder
from batchgen.errors import InputError, RowError
from batchgen.job.config import RunConfig


def make_prompt_builder(cfg: RunConfig, tokenizer) -> PromptBuilder:
    chat_fn = None
    if cfg.messages_column:
        if not getattr(tokenizer, "chat_template", None):
            raise InputError(
                f"--messages-column {cfg.messages_column} needs a chat template, and this "
                "model's tokenizer has none; render prompts with --template instead"
            )

        def chat_fn(messages: list[dict]) -> str:
            return tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True
            )

    plain = cfg.prompt_column if not (cfg.template or cfg.messages_column) else None
    return PromptBuilder(plain, cfg.messages_column, cfg.template, chat_fn)


def openai_prompt_builders(cfg: RunConfig, tokenizer) -> tuple[PromptBuilder, PromptBuilder]:
    """(completions, chat) builders of an OpenAI batch file, whose lines may mix both kinds."""
    if cfg.template or cfg.messages_column or cfg.id_column:
        raise InputError(
            "an OpenAI batch file carries its own prompts and ids (custom_id); "
            "drop --template, --messages-column and --id-column"
        )

    def chat_fn(messages: list[dict]) -> str:
        if not getattr(tokenizer, "chat_template", None):
            raise RowError("a /v1/chat/completions line needs a chat template; this model has none")
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    return PromptBuilder("prompt"), PromptBuilder(None, "messages", None, chat_fn)
