"""Prompt sources and the prompt batches the controller feeds to the graph each iteration.

``load_data`` turns a graph's ``data`` section into train and validation rows: a built-in
task (``data.source: builtin:NAME``), or local files read with HF ``datasets``
(``data.train_files`` / ``data.val_files``, or the older ``data.source: FILE.jsonl``).
``PromptDataset`` serves the train rows as fixed-size batches, epoch after epoch, with a
resumable position; ``collate_prompts`` turns any list of rows into one batch (train and
validation share it).

A file is parquet (``.parquet``) or JSON lines (``.jsonl`` / ``.json``), one prompt a row, in
verl's schema or the short one::

    {"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": "..."}],
     "ability": "math", "reward_model": {"style": "rule", "ground_truth": "72"},
     "extra_info": {...}}
    {"prompt": "raw text", "ground_truth": "72"}

A row is ``{"prompt", "ground_truth", "data_source", "extra_info", "origin"}``; ``origin`` is
``FILE:LINE`` (JSONL) or ``FILE:row N`` (parquet, 0-based) for error messages. A prompt given
as chat messages is rendered with the tokenizer's chat template (``add_generation_prompt``; a
``system_prompt`` is put first when the messages have no system message); a string prompt is
tokenized as it is (with a ``system_prompt`` and a chat template, it is the user's message).
The rendered ids are exactly what the rollout starts from.

A batch is a ``TensorDict`` with batch size ``[B]`` holding the ``prompts`` fields of
``hybridflow.data.keys``::

    PROMPT_IDS    (B, P) int64  left-padded with the pad id; P = longest prompt in the batch
    PROMPT_MASK   (B, P) int64  1 on real prompt tokens (a pad id inside a prompt is real)
    UID           (B,)   int64  distinct per prompt (a running counter)
    PROMPT_TEXT   (B,)   str    NonTensorStack: the rendered prompt text
    GROUND_TRUTH  (B,)   str    NonTensorStack: one string per sample ("" when unknown)
    DATA_SOURCE   (B,)   str    NonTensorStack: the row's data_source ("" when unknown)
    EXTRA_INFO    (B,)   str    NonTensorStack: the row's extra_info as JSON

The strings are stored with ``NonTensorStack.from_list`` so indexing, ``torch.cat`` and pickling
keep one string per sample. (``td.set_non_tensor(key, list)`` would store the whole list as a
single value shared by every sample.) Read them back with ``td[key]`` (a list subclass) or
``td.get(key).tolist()``.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from numbers import Real
from pathlib import Path

import torch
from tensordict import NonTensorStack, TensorDict
from transformers import PreTrainedTokenizerBase

from hybridflow.data import keys
from hybridflow.data.echo import shorten
from hybridflow.data.tasks import TASKS
from hybridflow.data.tokenizer import is_char_tokenizer

log = logging.getLogger(__name__)

BUILTIN_PREFIX = "builtin:"
ORIGIN = "origin"  # row field: where the row came from, for error messages
FIELD = "field"  # row field: the graph-file field that named its file (data.train_files, ...)
NO_TRUTH = "no_ground_truth"  # row field: the schema field a row lacking a ground truth lacks
ROLES = ("system", "user", "assistant", "tool")


class DataError(ValueError):
    """Bad prompt data; the message is one line naming the file/row and what was expected.
    ``field`` is the graph-file field that named the data."""

    def __init__(self, message: str, field: str = "data.source"):
        super().__init__(message)
        self.field = field


def _builtin_makers() -> dict:
    from hybridflow.data.arith_words import make_problems

    return {"arith_words": make_problems}


# -- loading rows -----------------------------------------------------------------------------


def load_data(data, graph_file: str | Path | None, all_val_files: bool = False) -> tuple[list[dict], list[dict]]:
    """Train and validation rows of a ``DataSpec``.

    ``val_files`` give the validation rows (the first ``data.num_val``, or all of them with
    ``all_val_files``); else the last ``num_val`` rows of ``train_files`` or of a JSONL
    ``data.source``, or the built-in task's prompts made after its train prompts. File paths
    are taken from the current directory, else from the graph file's directory.
    """
    from hybridflow.spec.loading import resolve_relative

    def read(field: str, files) -> list[dict]:
        rows = []
        for path in [files] if isinstance(files, str) else files:
            rows += read_rows(str(resolve_relative(path, graph_file)), field)
        return rows

    base_dir = str(Path(graph_file).resolve().parent) if graph_file and Path(graph_file).is_file() else "."
    num_val = 0 if data.val_files is not None else data.num_val
    if data.train_files is not None:
        train = read("data.train_files", data.train_files)
        keep = min(num_val, len(train) - 1)
        train, val = train[: len(train) - keep], train[len(train) - keep :]
    else:
        train, val = load_prompt_rows(data.source, base_dir, data.num_train, num_val, data.seed)
    if data.val_files is not None:
        val = read("data.val_files", data.val_files)
        val = val if all_val_files else val[: data.num_val]
    return train, val


def load_prompt_rows(
    source: str, base_dir: str, num_train: int, num_val: int, seed: int
) -> tuple[list[dict], list[dict]]:
    """Train and validation rows of ``data.source``.

    ``"builtin:NAME"`` makes ``num_train + num_val`` distinct prompts of the built-in task from
    ``seed`` (the first ``num_train`` train, the rest validation, so the splits are disjoint).
    Anything else is a JSONL file (relative paths against ``base_dir``) of rows (module
    docstring); its last ``num_val`` rows are the validation split, fewer if that would leave
    no train row. ``num_train`` only applies to built-in tasks.
    """
    if source.startswith(BUILTIN_PREFIX):
        rows = _builtin_rows(source, num_train + num_val, seed)
        return rows[:num_train], rows[num_train:]
    path = source if os.path.isabs(source) else os.path.join(base_dir, source)
    if not os.path.isfile(path):
        raise DataError(
            f"{shorten(path)}: no such prompt file (data.source {shorten(repr(source))}, "
            f'expected "builtin:NAME" or a JSONL file)'
        )
    rows = read_rows(path, "data.source")
    num_val = min(num_val, len(rows) - 1)
    split = len(rows) - num_val
    return rows[:split], rows[split:]


def _builtin_rows(source: str, num: int, seed: int) -> list[dict]:
    name = source[len(BUILTIN_PREFIX) :]
    makers = _builtin_makers()
    if name in makers:
        raw = makers[name](num, seed)
        return [_row(r, f"{source} prompt {i}", "data.source") for i, r in enumerate(raw)]
    if name not in TASKS:
        raise DataError(
            f"data.source {shorten(repr(source))}: unknown built-in task {shorten(repr(name))}, "
            f"expected one of {sorted([*TASKS, *makers])}"
        )
    task = TASKS[name]
    if num > task.num_distinct_prompts:
        raise DataError(
            f"data.source {source!r}: num_train + num_val = {num} but the task has only "
            f"{task.num_distinct_prompts} distinct prompts"
        )
    rows = task.make_prompts(num, seed)
    return [{**row, ORIGIN: f"{source} prompt {i}"} for i, row in enumerate(rows)]


def read_rows(path: str, field: str = "data.train_files") -> list[dict]:
    """The rows of one parquet or JSONL file, read with HF ``datasets`` and checked row by row."""
    raw, wheres = read_records(path, field)
    return [_row(obj, where, field) for obj, where in zip(raw, wheres)]


def read_records(path: str, field: str = "data.train_files") -> tuple[list[dict], list[str]]:
    """The raw records of one parquet, JSONL or JSON file (at least one), read with HF ``datasets``,
    and where each came from (``FILE:LINE`` or ``FILE:row N``); no check of their fields."""
    if os.path.isdir(path):
        raise DataError(f"{shorten(path)}: is a directory, expected a .parquet, .jsonl or .json file ({field})", field)
    if not os.path.isfile(path):
        raise DataError(f"{shorten(path)}: no such data file ({field})", field)
    if path.endswith(".parquet"):
        _check_parquet_columns(path, field)
        raw = _read_with_datasets(path, "parquet", field)
        wheres = [f"{path}:row {i}" for i in range(len(raw))]
    elif path.endswith((".jsonl", ".json")):
        raw, wheres = _read_jsonl(path, field)
    else:
        raise DataError(f"{path}: expected a .parquet, .jsonl or .json file ({field})", field)
    if not raw:
        raise DataError(f"{path}: expected at least one row, found none", field)
    return raw, wheres


def _quiet(datasets) -> None:
    # Progress bars and its own log lines for a file it cannot read: our DataError says it.
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)


def _check_parquet_columns(path: str, field: str) -> None:
    """What ``datasets`` would only call a DatasetGenerationError: no rows, or a column name
    given twice (pyarrow writes such files; a table cannot hold them)."""
    import pyarrow.parquet as pq

    try:
        metadata = pq.read_metadata(path)
    except Exception:  # not parquet at all: _read_with_datasets says so
        return
    names = metadata.schema.to_arrow_schema().names
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        raise DataError(f"{shorten(path)}: duplicated column {shorten(repr(twice[0]))}; expected each column once", field)
    if metadata.num_rows == 0:
        raise DataError(f"{shorten(path)}: expected at least one row, found none", field)


def _read_with_datasets(path: str, kind: str, field: str) -> list[dict]:
    import datasets

    _quiet(datasets)
    try:
        loaded = getattr(datasets.Dataset, f"from_{kind}")(path, keep_in_memory=True)
    except Exception as exc:  # pyarrow raises several kinds for a broken file
        raise DataError(f"{path}: cannot read as {kind} ({type(exc).__name__}: {str(exc)[:200]})", field) from None
    return loaded.to_list()


def _read_jsonl(path: str, field: str) -> tuple[list[dict], list[str]]:
    """JSONL rows and their ``FILE:LINE`` origins (a ``.json`` file may instead hold one array
    of rows: ``FILE:row N``). Read with ``datasets``; where pyarrow
    cannot (a broken line, or a column whose type changes between rows), each line is parsed
    on its own, so a bad line is named and mixed types still load."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise DataError(f"{path}: cannot read data file ({e.strerror})", field) from None
    try:
        lines = raw.decode("utf-8").splitlines()
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        column = e.start - raw.rfind(b"\n", 0, e.start)
        raise DataError(
            f"{path}:{line}: invalid UTF-8 at byte {column} of the line ({e.reason}); expected UTF-8 text", field
        ) from None
    text = "\n".join(lines)
    if path.endswith(".json") and text.lstrip().startswith("["):
        parsed, wheres = _parse_json_array(text, path, field)
    else:
        numbered = [(n, line) for n, line in enumerate(lines, start=1) if line.strip()]
        wheres = [f"{path}:{n}" for n, _ in numbered]
        parsed = []
        for n, line in numbered:
            try:
                parsed.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{n}: expected valid JSON ({e.msg} at column {e.colno})", field) from None
            if not isinstance(parsed[-1], dict):
                raise DataError(f"{path}:{n}: expected a JSON object", field)
    if not parsed:
        return [], []
    try:
        import datasets

        _quiet(datasets)
        rows = datasets.Dataset.from_json(path, keep_in_memory=True).to_list()
    except Exception:  # types that differ between rows: the plain parse above is the data
        rows = parsed
    if len(rows) != len(parsed):
        rows = parsed
    # pyarrow fills a key missing from a row with None; the plain parse says what was written.
    return [{k: v for k, v in row.items() if k in own} for row, own in zip(rows, parsed)], wheres


def _parse_json_array(text: str, path: str, field: str) -> tuple[list[dict], list[str]]:
    """The rows of a ``.json`` file holding one array of objects (as many data sets are
    downloaded), each named ``FILE:row N`` (0-based) like a parquet row."""
    try:
        parsed = json.loads(text)
    except json.JSONDecodeError as e:
        raise DataError(f"{path}:{e.lineno}: expected valid JSON ({e.msg} at column {e.colno})", field) from None
    for i, row in enumerate(parsed):
        if not isinstance(row, dict):
            raise DataError(f"{path}:row {i}: expected a JSON object", field)
    return parsed, [f"{path}:row {i}" for i in range(len(parsed))]


def check_messages(messages: list, where: str, field: str, name: str) -> list[dict]:
    """Chat messages as plain ``{role, content}`` dicts; ``DataError``
    naming ``name[i]`` and its role or content when one is not such a message."""
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise DataError(f"{where}: {name}[{i}]: expected a {{role, content}} message", field)
        if message.get("role") not in ROLES:
            raise DataError(
                f"{where}: {name}[{i}].role: expected one of {', '.join(ROLES)}, "
                f"got {shorten(repr(message.get('role')))}",
                field,
            )
        if not isinstance(message.get("content"), str):
            raise DataError(f"{where}: {name}[{i}].content: expected a string", field)
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def check_prompt(prompt, where: str, field: str) -> str | list[dict]:
    """A row's ``prompt``: a non-empty string, or chat messages (``check_messages``)."""
    if isinstance(prompt, str):
        if not prompt:
            raise DataError(f'{where}: prompt: expected a non-empty string', field)
        return prompt
    if isinstance(prompt, list) and prompt:
        return check_messages(prompt, where, field, "prompt")
    raise DataError(f'{where}: prompt: expected a string or a list of {{role, content}} messages', field)


def _row(obj: dict, where: str, field: str) -> dict:
    """One checked row (module docstring) of a raw verl or short-schema record."""
    prompt = check_prompt(obj.get("prompt"), where, field)
    reward_model = obj.get("reward_model")
    if reward_model is not None:
        if not isinstance(reward_model, dict):
            raise DataError(f"{where}: reward_model: expected an object with ground_truth", field)
        truth, truth_field = reward_model.get("ground_truth"), "reward_model.ground_truth"
    else:
        truth, truth_field = obj.get("ground_truth"), "ground_truth"
    missing = truth_field if truth is None else None
    if truth is None:
        truth = ""
    elif isinstance(truth, Real) and not isinstance(truth, bool):
        truth = str(truth)
    elif not isinstance(truth, str):
        raise DataError(f"{where}: {truth_field}: expected a string or a number", field)
    data_source = obj.get("data_source") or ""
    if not isinstance(data_source, str):
        raise DataError(f"{where}: data_source: expected a string", field)
    extra_info = obj.get("extra_info")
    try:
        extra_json = json.dumps(extra_info)
    except (TypeError, ValueError):
        raise DataError(f"{where}: extra_info: expected JSON-serialisable data", field) from None
    return {
        "prompt": prompt,
        "ground_truth": truth,
        "data_source": data_source,
        "extra_info": extra_json,
        ORIGIN: where,
        FIELD: field,
        NO_TRUTH: missing,
    }


def check_ground_truth(rows: Sequence[dict], why: str) -> None:
    """``DataError`` naming the first row (file, row, field) that has no ground truth, for a
    scorer that needs one (``why``: which, and how to say it needs none)."""
    for row in rows:
        if row.get(NO_TRUTH):
            raise DataError(f"{row[ORIGIN]}: {row[NO_TRUTH]}: missing; {why}", row[FIELD])


# -- batches ----------------------------------------------------------------------------------


def render_prompt(row: dict, tokenizer: PreTrainedTokenizerBase, system_prompt: str | None = None) -> tuple[str, list[int]]:
    """A row's prompt as text and token ids: chat messages through the tokenizer's chat
    template with ``add_generation_prompt`` (``system_prompt`` first unless the messages start
    with a system message); a string as it is, no special tokens added, unless a
    ``system_prompt`` is given and the tokenizer has a chat template: then the string is the
    user's message (a built-in task's ``"12*34="`` for a chat model)."""
    prompt = row["prompt"]
    chat = getattr(tokenizer, "chat_template", None) is not None
    if isinstance(prompt, str) and not (system_prompt is not None and chat):
        return prompt, list(tokenizer(prompt, add_special_tokens=False)["input_ids"])
    if isinstance(prompt, str):  # a system prompt makes a string prompt the user's message
        prompt = [{"role": "user", "content": prompt}]
    if getattr(tokenizer, "chat_template", None) is None:
        raise DataError(
            f"{row.get(ORIGIN, 'a prompt row')}: prompt: chat messages need a tokenizer with a chat "
            "template; this one has none (give string prompts)"
        )
    messages = list(prompt)
    if system_prompt is not None and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": system_prompt})
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    return text, list(ids)


def encode_prompts(
    rows: Sequence[dict],
    tokenizer: PreTrainedTokenizerBase,
    max_prompt_length: int,
    system_prompt: str | None = None,
) -> list[tuple[str, list[int]]]:
    """Rendered text and token ids of each row's prompt (``render_prompt``); ``DataError`` if
    one is empty or longer than ``max_prompt_length``, naming the row."""
    rendered = [render_prompt(row, tokenizer, system_prompt) for row in rows]
    unknown = []  # origins of prompts holding characters a pretrained tokenizer encodes as unk
    for i, (row, (text, ids)) in enumerate(zip(rows, rendered)):
        where, field = row.get(ORIGIN, f"prompt row {i}"), row.get(FIELD, "data.source")
        if not 1 <= len(ids) <= max_prompt_length:
            prompt = row["prompt"]
            shown = prompt if isinstance(prompt, str) else prompt[-1]["content"]
            what = "" if isinstance(prompt, str) else " after the chat template"
            raise DataError(
                f"{where}: prompt {shorten(repr(shown))} is {len(ids)} tokens{what}, expected 1 to "
                f"data.max_prompt_length = {max_prompt_length}",
                field,
            )
        if tokenizer.unk_token_id is None or tokenizer.unk_token_id not in ids:
            continue
        if not is_char_tokenizer(tokenizer):
            unknown.append(where)
            continue
        vocab = tokenizer.get_vocab()
        missing = "".join(sorted({c for c in text if c not in vocab}))
        raise DataError(
            f"{where}: prompt has characters outside the built-in task's tokenizer: "
            f"{shorten(repr(missing))}; expected only its alphabet (a pretrained actor's tokenizer "
            "takes any text)",
            field,
        )
    if unknown:
        log.warning("%d of %d prompts hold characters the tokenizer encodes as %s (first: %s)",
                    len(unknown), len(rows), tokenizer.unk_token, unknown[0])
    return rendered


def collate_prompts(
    rows: Sequence[dict],
    tokenizer: PreTrainedTokenizerBase,
    max_prompt_length: int,
    uid_start: int = 0,
    system_prompt: str | None = None,
) -> TensorDict:
    """One prompt batch (module docstring) of ``rows``, uids ``uid_start, uid_start + 1, ...``.

    Prompts are left-padded to the longest prompt **in this batch**, not to
    ``max_prompt_length``, which only bounds it.
    """
    rendered = encode_prompts(rows, tokenizer, max_prompt_length, system_prompt)
    return _to_batch(rows, rendered, _pad_id(tokenizer), uid_start)


def validation_batches(
    rows: Sequence[dict],
    tokenizer: PreTrainedTokenizerBase,
    max_prompt_length: int,
    chunk_size: int | None = None,
    system_prompt: str | None = None,
) -> list[TensorDict]:
    """The validation rows as batches of at most ``chunk_size`` prompts (None: one batch),
    uids ``0 .. len(rows) - 1`` across them; no batch for no rows."""
    chunk_size = chunk_size or max(len(rows), 1)
    return [
        collate_prompts(rows[start : start + chunk_size], tokenizer, max_prompt_length, start, system_prompt)
        for start in range(0, len(rows), chunk_size)
    ]


def _pad_id(tokenizer: PreTrainedTokenizerBase) -> int:
    if tokenizer.pad_token_id is None:
        raise DataError(f"tokenizer {type(tokenizer).__name__} has no pad token, expected one")
    return tokenizer.pad_token_id


def _to_batch(
    rows: Sequence[dict], rendered: Sequence[tuple[str, Sequence[int]]], pad_id: int, uid_start: int
) -> TensorDict:
    assert rows and len(rows) == len(rendered), "a batch needs one id list per row"
    all_ids = [ids for _, ids in rendered]
    num_prompts = len(rows)
    prompt_length = max(len(ids) for ids in all_ids)
    prompt_ids = torch.full((num_prompts, prompt_length), pad_id, dtype=torch.int64)
    prompt_mask = torch.zeros((num_prompts, prompt_length), dtype=torch.int64)
    for i, ids in enumerate(all_ids):
        prompt_ids[i, prompt_length - len(ids) :] = torch.tensor(ids, dtype=torch.int64)
        prompt_mask[i, prompt_length - len(ids) :] = 1
    return TensorDict(
        {
            keys.PROMPT_IDS: prompt_ids,
            keys.PROMPT_MASK: prompt_mask,
            keys.UID: torch.arange(uid_start, uid_start + num_prompts, dtype=torch.int64),
            keys.PROMPT_TEXT: NonTensorStack.from_list([text for text, _ in rendered]),
            keys.GROUND_TRUTH: NonTensorStack.from_list(
                [row.get("ground_truth", "") for row in rows]
            ),
            keys.DATA_SOURCE: NonTensorStack.from_list([row.get("data_source", "") for row in rows]),
            keys.EXTRA_INFO: NonTensorStack.from_list([row.get("extra_info", "null") for row in rows]),
        },
        batch_size=[num_prompts],
    )


class PromptDataset:
    """Endless fixed-size prompt batches over the train rows, epoch after epoch.

    Every ``next_batch()`` holds exactly ``prompts_per_iteration`` prompts; a batch that runs
    past the end of an epoch continues into the next. With ``shuffle`` each epoch's order is a
    permutation drawn from a ``torch.Generator`` seeded from ``(seed, epoch)``, so the order
    depends only on those and ``state_dict()`` (epoch, position, next uid) resumes exactly.
    All prompts are tokenized and checked against ``max_prompt_length`` up front, so a bad
    row stops the run before its first iteration. A subclass serving other rows (preference
    pairs) overrides ``_encode`` and ``_batch``; the order and resume state are the same.
    """

    unit = "prompts"  # what a row is, for messages

    def __init__(
        self,
        rows: Sequence[dict],
        tokenizer: PreTrainedTokenizerBase,
        max_prompt_length: int,
        prompts_per_iteration: int,
        shuffle: bool = True,
        seed: int = 0,
        system_prompt: str | None = None,
    ) -> None:
        if not rows:
            raise DataError(f"no training {self.unit}, expected at least one row")
        if prompts_per_iteration < 1:
            raise ValueError(f"{self.unit} per iteration must be >= 1, got {prompts_per_iteration}")
        self._rows = list(rows)
        self._rendered = self._encode(self._rows, tokenizer, max_prompt_length, system_prompt)
        self._pad_id = _pad_id(tokenizer)
        self.prompts_per_iteration = prompts_per_iteration
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.position = 0  # index into this epoch's order of the next prompt to serve
        self.next_uid = 0
        self._order = self._epoch_order(0)

    def __len__(self) -> int:
        return len(self._rows)

    def __iter__(self) -> "PromptDataset":
        return self

    def __next__(self) -> TensorDict:
        return self.next_batch()

    def next_batch(self) -> TensorDict:
        """The next ``prompts_per_iteration`` prompts as a batch (module docstring)."""
        picked = []
        while len(picked) < self.prompts_per_iteration:
            if self.position == len(self._rows):
                self.epoch += 1
                self.position = 0
                self._order = self._epoch_order(self.epoch)
            take = min(self.prompts_per_iteration - len(picked), len(self._rows) - self.position)
            picked.extend(self._order[self.position : self.position + take])
            self.position += take
        rows = [self._rows[i] for i in picked]
        batch = self._batch(rows, [self._rendered[i] for i in picked], self.next_uid)
        self.next_uid += len(picked)
        return batch

    def _encode(self, rows: list[dict], tokenizer, max_prompt_length: int, system_prompt: str | None) -> list:
        return encode_prompts(rows, tokenizer, max_prompt_length, system_prompt)

    def _batch(self, rows: list[dict], encoded: list, uid_start: int) -> TensorDict:
        return _to_batch(rows, encoded, self._pad_id, uid_start)

    def state_dict(self) -> dict[str, int]:
        return {
            "epoch": self.epoch,
            "position": self.position,
            "next_uid": self.next_uid,
            "num_rows": len(self._rows),
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state["num_rows"] != len(self._rows):
            raise DataError(
                f"resume state is for {state['num_rows']} {self.unit}, this dataset has "
                f"{len(self._rows)}: expected the same data and split"
            )
        if not 0 <= state["position"] <= len(self._rows):
            raise ValueError(f"resume position {state['position']} outside 0..{len(self._rows)}")
        self.epoch = state["epoch"]
        self.position = state["position"]
        self.next_uid = state["next_uid"]
        self._order = self._epoch_order(self.epoch)

    def _epoch_order(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(len(self._rows)))
        # Mix seed and epoch into one 63-bit seed; distinct (seed, epoch) pairs stay distinct
        # for any epoch count a run can reach.
        generator = torch.Generator().manual_seed((self.seed * 1_000_003 + epoch) % 2**63)
        return torch.randperm(len(self._rows), generator=generator).tolist()
