"""TFDS builders for the offline corpora (`text_corpus.CORPORA`), prepared without TF.

tensorflow-datasets 4.9.10 prepares a `GeneratorBasedBuilder` into ArrayRecord
files without TensorFlow (only `tfds.core` and `array_record` are needed), and
`tfds.data_source` reads it back, also without TF. Shuffling at preparation is
disabled so that record i of the prepared split is document i of
`text_corpus.iter_documents(split, name)`: the TFDS path and the TFDS-free path in
`data.py` then feed the exact same documents in the same order.

Importing this module registers a builder under each corpus's name, so
`tfds.data_source("twell_stdlib_text", data_dir=...)` works afterwards.
"""

import contextlib
import fcntl
import os

from etils import epath
import tensorflow_datasets as tfds
from tensorflow_datasets.core.utils import py_utils

from train.corpus import text_corpus


class TwellStdlibText(tfds.core.GeneratorBasedBuilder):
  """Docstrings of the local Python standard library, one per example."""

  name = text_corpus.NAME
  VERSION = tfds.core.Version("1.1.0")
  RELEASE_NOTES = {"1.0.0": "Initial release.",
                   "1.1.0": "Held out by content; each text once per split."}

  # tfds 4.9.10's default `code_path` lazily imports the `importlib_resources`
  # backport (only declared for Python < 3.9) for builders that live in a
  # package; naming the file directly avoids that dead dependency.
  code_path = py_utils.classproperty(
      classmethod(lambda cls: epath.Path(__file__)))

  def _info(self) -> tfds.core.DatasetInfo:
    # DatasetInfo directly: dataset_info_from_configs would look for metadata
    # files next to this module.
    return tfds.core.DatasetInfo(
        builder=self,
        description=__doc__,
        features=tfds.features.FeaturesDict({"text": tfds.features.Text()}),
        disable_shuffling=True,
    )

  def _split_generators(self, dl_manager):
    del dl_manager  # Nothing to download.
    return {split: self._generate_examples(split)
            for split in text_corpus.SPLITS}

  def _generate_examples(self, split):
    for key, text in text_corpus.iter_documents(split, self.name):
      yield key, {"text": text}


class TwellPythonSource(TwellStdlibText):
  """Source files of the local Python standard library, one per example."""

  name = text_corpus.SOURCE_NAME


class TwellPythonSourceSite(TwellStdlibText):
  """Source files of the standard library and the installed packages, one per example."""

  name = text_corpus.SITE_NAME


BUILDERS = {b.name: b for b in (TwellStdlibText, TwellPythonSource, TwellPythonSourceSite)}


@contextlib.contextmanager
def _exclusive(data_dir: str, name: str):
  """One process at a time prepares: two runs started together on a fresh machine would
  otherwise both build into temporary directories and the second rename would fail."""
  os.makedirs(data_dir, exist_ok=True)
  with open(os.path.join(data_dir, f".{name}.lock"), "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    try:
      yield
    finally:
      fcntl.flock(lock, fcntl.LOCK_UN)


def prepare(data_dir: str, name: str = text_corpus.NAME) -> TwellStdlibText:
  """Builds corpus `name`'s ArrayRecord files under data_dir (no-op if already there); safe
  to call from several processes at once."""
  with _exclusive(os.fspath(data_dir), name):
    builder = BUILDERS[name](data_dir=data_dir, file_format="array_record")
    builder.download_and_prepare()
  return builder
