"""TFDS sources: read any prepared dataset through `tfds.data_source`, and build one from local text.

`build_text_dataset` turns files into an ArrayRecord TFDS dataset (one document per file, feature
`text`) in a data dir. TFDS writes into a temporary folder and renames it only when every shard is
written, so a failed build leaves nothing that reads as complete. A name that is already built is
refused unless `overwrite` is given (TFDS would otherwise keep the old dataset and read no file).
"""

from __future__ import annotations

import contextlib
import glob
import os
import re
import shutil
import tempfile
from collections.abc import Iterator, Sequence

import tensorflow_datasets as tfds

from metatrain import paths as paths_lib
from metatrain.data.corpus import DecodeStats, expand_paths, read_text
from metatrain.errors import ConfigError, DataError

DEFAULT_DATA_DIR = os.environ.get("TFDS_DATA_DIR", os.path.expanduser("~/tensorflow_datasets"))


class TextSource:
    """Random access to the `text` feature (or the first text-like feature) of a TFDS data source."""

    def __init__(self, source, feature: str):
        self.source, self.feature = source, feature

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, i: int) -> str:
        value = self.source[i][self.feature]
        return value.decode("utf-8", errors="replace") if isinstance(value, bytes) else str(value)


@contextlib.contextmanager
def _tfds_temporary_folders() -> Iterator[None]:
    """While it runs, the temporary folders made in this process go into one that is removed after. TFDS looks for
    the info of a registered dataset that is not prepared on its GCS bucket, in a temporary folder it never
    removes (offline, an empty one per look-up)."""
    with tempfile.TemporaryDirectory(prefix="metatrain-tfds-") as folder:
        previous, tempfile.tempdir = tempfile.tempdir, folder
        try:
            yield
        finally:
            tempfile.tempdir = previous


def text_source(name: str, split: str = "train", data_dir: str | None = None) -> TextSource:
    data_dir = data_dir or DEFAULT_DATA_DIR
    try:
        with _tfds_temporary_folders():
            source = tfds.data_source(name, split=split, data_dir=data_dir, download=False)
    except Exception as e:  # noqa: BLE001 — TFDS raises several types for "not there"
        raise DataError(
            f"data.source: TFDS dataset {name!r} (split {split!r}) is not prepared in {data_dir} "
            f"({type(e).__name__}); if it is prepared in another folder, name that folder (data.data_dir=DIR, or "
            f"--data-dir DIR in `metatrain data`); else prepare it "
            f"with `tfds build {name} --data_dir {data_dir} --file_format array_record` on a machine with network "
            f"access, or build one from local text with `metatrain data build`") from None
    if len(source) == 0:
        raise DataError(f"data.source: TFDS dataset {name!r} split {split!r} in {data_dir} is empty")
    features = source[0]
    feature = "text" if "text" in features else next(
        (k for k, v in features.items() if isinstance(v, (bytes, str))), None)
    if feature is None:
        raise DataError(f"data.source: TFDS dataset {name!r} has no text feature (features: {sorted(features)})")
    return TextSource(source, feature)


def build_text_dataset(paths: Sequence[str], name: str, data_dir: str | None = None,
                       overwrite: bool = False) -> tuple[str, DecodeStats]:
    """Local text files, folders or globs → TFDS dataset `name` in `data_dir`. Returns its path and decode stats."""
    if not re.fullmatch(r"[a-z][a-z0-9_]*", name):
        raise ConfigError(f"--name {name!r}: a dataset name must be snake_case (lowercase letters, digits, _)")
    files = expand_paths(paths)
    data_dir = data_dir or DEFAULT_DATA_DIR
    existing = os.path.join(data_dir, name)
    if glob.glob(os.path.join(existing, "*", "dataset_info.json")) and not overwrite:
        raise DataError(f"--name {name!r}: a dataset of that name already exists at {existing}; pass --overwrite "
                        f"to rebuild it from these files, or choose another --name")
    if os.path.exists(existing):  # --overwrite, or what a failed build left behind
        shutil.rmtree(existing)
    stats = DecodeStats()

    def generate():
        empty = True
        for i, f in enumerate(files):
            text = read_text(f, stats)
            if text.strip():
                empty = False
                yield i, {"text": text}
        if empty:
            raise DataError(f"the corpus is empty: all {len(files)} file(s) hold no text")

    with tfds.core.registered.skip_registration():
        builder_cls = type(name, (_TextBuilder,), {"name": name, "_generate": staticmethod(generate)})
    builder = builder_cls(data_dir=data_dir, file_format="array_record")
    # a failed build (a full disk, Ctrl-C) leaves nothing half-made; TFDS's download folder (it downloads nothing
    # here) is a temporary one, not `downloads/extracted` left in the user's data dir
    with paths_lib.filled_dir(existing), tempfile.TemporaryDirectory(prefix="metatrain-tfds-") as downloads:
        builder.download_and_prepare(download_dir=downloads)
    return builder.data_dir, stats


class _LocalInfo(tfds.core.DatasetInfo):
    """The info of a dataset built here from local files: none is ever on TFDS's GCS bucket. (TFDS looks there for
    a dataset it has no info of yet, and first makes a temporary folder that it never removes.)"""

    def initialize_from_bucket(self) -> None:
        pass


class _TextBuilder(tfds.core.GeneratorBasedBuilder):
    VERSION = tfds.core.Version("1.0.0")
    _generate = None

    def _info(self):
        return _LocalInfo(builder=self, features=tfds.features.FeaturesDict({"text": tfds.features.Text()}))

    def _split_generators(self, dl_manager):
        return {"train": self._generate_examples()}

    def _generate_examples(self):
        yield from self._generate()
