"""``vlm-pack prepare``: command-line front end of :func:`vlm_pack.offline.prepare.prepare_packed_sequence_data`."""

from __future__ import annotations

import argparse
from pathlib import Path

from .algorithms import ALGORITHMS
from .encoding import TEMPLATES


def add_prepare_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register the ``prepare`` subcommand (sets ``func=run_prepare``)."""
    p = subparsers.add_parser(
        "prepare",
        help="tokenise an SFT dataset, bin-pack it and write packs + metadata for offline packed training",
        description=(
            "Tokenise a dataset file (JSONL, JSON, parquet, CSV, Arrow) or a saved `datasets` directory in one of "
            "TRL's formats (messages, prompt/completion, text) or prompt/response once, pack samples into "
            "fixed-size packs and write "
            "<output-dir>/packed/<tokenizer-name>/training_<size>.npy (+ validation_<size>.npy, "
            "<size>_metadata.jsonl). "
            "A .npy input (reference pickle format, needs --allow-pickle) is converted as is."
        ),
    )
    p.add_argument("--input", required=True,
                   help="training data: a JSONL, JSON, parquet, CSV/TSV or Arrow file, a `save_to_disk` directory, "
                        "or a reference .npy")
    p.add_argument("--tokenizer", required=True, help="local tokenizer directory (AutoTokenizer.from_pretrained)")
    p.add_argument("--output-dir", required=True, help="root folder; packs go to <output-dir>/packed/<tokenizer-name>/")
    p.add_argument("--pack-sizes", type=int, nargs="+", required=True, help="one or more pack sizes in tokens")
    p.add_argument("--validation", default=None, help="validation data (same formats as --input)")
    p.add_argument("--validation-fraction", type=float, default=0.0,
                   help="hold out this seeded random fraction of the training rows instead of --validation")
    add_format_arguments(p)
    p.add_argument("--chat-template", default=None, metavar="FILE",
                   help="jinja chat template file to render chats with instead of the tokenizer's own (default: the "
                        "tokenizer's own template; assistant labels come from its {%% generation %%} blocks, TRL's "
                        "training variant of it, or per-turn markers proven not to change the rendering; a template "
                        "where none of these works is refused, naming the fix)")
    p.add_argument("--max-seq-length", type=int, default=None,
                   help="truncate longer samples to this many tokens (counted; samples left without response dropped)")
    p.add_argument("--algorithm", choices=ALGORITHMS, default="best_fit_decreasing",
                   help="bin-packing rule (default best_fit_decreasing: on real ShareGPT lengths it needs as few packs "
                        "as first_fit_decreasing, the same count to the pack, and runs faster; the *_shuffle "
                        "variants mix long and short samples within packs at about 1%% more packs; measured in "
                        "benchmarks/packing.py)")
    p.add_argument("--seed", type=int, default=0, help="seed of the shuffle algorithms and of --validation-fraction")
    p.add_argument("--pad-seq-to-mult", type=int, default=1,
                   help="pack on lengths rounded up to this multiple (context parallelism pads each sample to it)")
    p.add_argument("--num-proc", type=int, default=1,
                   help="tokenisation worker processes; the fast tokenizer already uses every core per batch, so this "
                        "only spreads Python-side rendering (chat templates) and is ignored for small inputs")
    p.add_argument("--global-batch-size", type=int, default=None, help="print the packs per step to use (GBS / n)")
    p.add_argument("--tokenizer-name", default=None,
                   help="output sub-folder name (default: the tokenizer folder's name)")
    p.add_argument("--cache-dir", default=None,
                   help="tokenisation cache, keyed on the input's content and settings (default: $VLM_PACK_CACHE or "
                        "~/.cache/vlm_pack); a re-run with the same content skips tokenising")
    p.add_argument("--overwrite", action="store_true",
                   help="replace existing output (the old output stays readable until the new one is complete); "
                        "output already made from the same input, tokenizer and settings is kept without this flag")
    p.add_argument("--allow-pickle", action="store_true",
                   help="allow reading a reference .npy (pickle: trusted files only)")
    p.add_argument("--no-progress", action="store_true", help="hide progress bars")
    p.set_defaults(func=run_prepare)
    return p


def add_format_arguments(p: argparse.ArgumentParser) -> None:
    """The dataset-format options (shared with ``vlm-pack stats``)."""
    p.add_argument("--template", choices=TEMPLATES, default="auto",
                   help="dataset format; auto (default): from the first record, in TRL's order: prompt + completion "
                        "(conversational lists: the chat prompt + completion, labelled on the completion; strings: "
                        "prompt_completion), messages (chat, labelled on assistant turns), prompt + response "
                        "(alpaca), text (language modelling, every token labelled); see docs/data_formats.md")
    p.add_argument("--prompt-field", default="prompt", help="the prompt field (default prompt)")
    p.add_argument("--completion-field", default="completion",
                   help="prompt-completion format: the completion field (default completion)")
    p.add_argument("--response-field", default="response",
                   help="alpaca template: the response field (default response)")
    p.add_argument("--messages-field", default="messages",
                   help="chat format: the messages list field (default messages)")
    p.add_argument("--text-field", default="text", help="text format: the text field (default text)")


add_parser = add_prepare_parser  # the name the `vlm-pack` dispatcher (vlm_pack/cli/main.py) looks up


def run_prepare(args: argparse.Namespace) -> int:
    """Run ``prepare`` from parsed arguments; returns the exit code."""
    from .prepare import PrepareOptions, prepare_packed_sequence_data  # not at module level: `--help` stays light

    chat_template = None
    if args.chat_template is not None:
        try:
            chat_template = Path(args.chat_template).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as err:
            raise ValueError(f"--chat-template {args.chat_template}: cannot read it ({err})") from None
    options = PrepareOptions(
        validation_path=args.validation, validation_fraction=args.validation_fraction, template=args.template,
        prompt_field=args.prompt_field, response_field=args.response_field, messages_field=args.messages_field,
        completion_field=args.completion_field, text_field=args.text_field, chat_template=chat_template,
        max_seq_length=args.max_seq_length, algorithm=args.algorithm, seed=args.seed,
        pad_seq_to_mult=args.pad_seq_to_mult, num_proc=args.num_proc, global_batch_size=args.global_batch_size,
        tokenizer_name=args.tokenizer_name, overwrite=args.overwrite, cache_dir=args.cache_dir,
        allow_pickle=args.allow_pickle, progress=not args.no_progress,
    )
    prepare_packed_sequence_data(args.input, args.tokenizer, args.output_dir, args.pack_sizes, options)
    return 0
