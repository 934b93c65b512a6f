"""README.md and docs/*.md run as written: every code block, by the rules of
`tests/docs_blocks.py` (unmarked blocks here on the CPU, `gpu` blocks in the GPU test,
`id=NAME` blocks in the test that fetches them), and the pages' references resolve."""

import os
import pathlib
import re

import pytest

import docs_blocks
import train_test_util as tu

ROOT = docs_blocks.ROOT


def _docs(gpu: bool) -> list[str]:
  return [str(p.relative_to(ROOT)) for p in docs_blocks.doc_files()
          if any(b.runs_here and b.gpu == gpu for b in docs_blocks.blocks(p))]


def _run_document(doc: str, gpu: bool, directory: pathlib.Path, env: dict) -> None:
  code = [b for b in docs_blocks.blocks(ROOT / doc) if b.runs_here and b.gpu == gpu]
  result = docs_blocks.run(code, directory, env, timeout=900)
  for where, (wall, cpu) in result.seconds.items():
    print(f"{where}: {wall:.1f} s wall, {cpu:.1f} s CPU")
  assert result.returncode == 0, (
      f"the block at {result.failed} failed:\n{result.output[-6000:]}")
  assert len(result.seconds) == len(code), result.output[-3000:]


@pytest.mark.parametrize("doc", _docs(gpu=False))
def test_cpu_blocks_run(doc, tmp_path):
  """Every unmarked python / bash block of `doc`, in order, on the CPU."""
  from train.data import pipeline  # pylint: disable=import-outside-toplevel
  env = tu.run_env()
  env.pop("PYTHONPATH")              # the sandbox's links, not the checkout, are imported
  if pipeline.tfds_available():      # the offline corpus, prepared once per machine
    env["TFDS_DATA_DIR"] = tu.offline_data_dir()
  _run_document(doc, False, tmp_path, env)


@pytest.mark.gpu
@pytest.mark.parametrize("doc", _docs(gpu=True))
def test_gpu_blocks_run(doc, tmp_path):
  """Every block of `doc` marked `gpu` or `gpus=N`, in order, on Hopper GPUs."""
  from pallas_kernels import _target  # pylint: disable=import-outside-toplevel
  import jax  # pylint: disable=import-outside-toplevel
  if not _target.on_hopper():
    pytest.skip("needs a Hopper GPU")
  needs = max(b.gpus for b in docs_blocks.blocks(ROOT / doc) if b.runs_here and b.gpu)
  if needs > jax.device_count():
    pytest.skip(f"{doc}'s blocks need {needs} GPUs, {jax.device_count()} here")
  _run_document(doc, True, tmp_path, dict(os.environ))


def test_runner_names_the_failing_block_and_keeps_tmp_private(tmp_path):
  """The runner's own contract: "/tmp/" maps into the sandbox, blocks run in order, a failing
  bash or python block is named by its file and line, with the failing line's number."""
  block = docs_blocks.Block
  wrote = block("docs/a.md", 3, "bash", "echo made > /tmp/twell_docs_probe\n")
  read = block("docs/a.md", 9, "python", "import pathlib\n"
               "assert pathlib.Path('/tmp/twell_docs_probe').read_text() == 'made\\n'\n")
  bash_fails = block("docs/b.md", 20, "bash", "echo fine\nfalse\necho never\n")
  python_fails = block("docs/c.md", 40, "python", "x = 1\nraise ValueError('boom')\n")
  result = docs_blocks.run([wrote, read, bash_fails], tmp_path / "one")
  assert result.failed == "docs/b.md:20", result.output
  assert "docs/b.md:22: exit status 1" in result.output and "never" not in result.output
  assert list(result.seconds) == ["docs/a.md:3", "docs/a.md:9"], result.output
  assert (tmp_path / "one" / "tmp" / "twell_docs_probe").exists()
  assert not pathlib.Path("/tmp/twell_docs_probe").exists()
  result = docs_blocks.run([python_fails], tmp_path / "two")
  assert result.failed == "docs/c.md:40", result.output
  assert 'File "docs/c.md", line 42' in result.output and "ValueError: boom" in result.output


def test_every_id_block_has_its_test():
  """A block marked id=NAME is run by some test under tests/ that calls find("NAME")."""
  sources = "\n".join(p.read_text() for p in (ROOT / "tests").glob("*.py"))
  ids = [b.id for b in docs_blocks.all_blocks() if b.id]
  assert len(ids) == len(set(ids)), ids
  orphans = [i for i in ids
             if f'find("{i}")' not in sources and f"find('{i}')" not in sources]
  assert not orphans, f"no test fetches the blocks {orphans}"


def test_config_blocks_carry_an_id():
  """yaml / json / toml blocks are run by a dedicated test, so each needs an id."""
  bare = [b.where for b in docs_blocks.all_blocks() if b.lang in docs_blocks.CONFIG and not b.id]
  assert not bare, f"config blocks without an id: {bare}"


def _commands(text: str) -> list[str]:
  return [l.strip() for l in text.splitlines() if l.strip() and not l.strip().startswith("#")]


def test_readme_install_and_test_are_ci():
  """The README's install and test commands are exactly the ones .ci/run runs (CI runs
  them; this test only compares)."""
  block = docs_blocks.find("install")
  assert block.path == "README.md" and block.lang == "bash", block.where
  ci = [c for c in _commands((ROOT / ".ci" / "run").read_text())
        if not c.startswith(("set ", "cd ", "export "))]
  assert _commands(block.code) == ci


_LINK = re.compile(r"\]\(([^)\s]+)\)")
_MODULE = re.compile(r"python3? -m ([A-Za-z_][\w.]*)")


def _anchors(path: pathlib.Path) -> set[str]:
  """The anchors GitHub gives the headings of the Markdown file `path`."""
  from markdown_it import MarkdownIt  # pylint: disable=import-outside-toplevel
  tokens = MarkdownIt("commonmark").parse(path.read_text())
  return {re.sub(r"[^\w\- ]", "", tokens[i + 1].content.strip().lower()).replace(" ", "-")
          for i, t in enumerate(tokens) if t.type == "heading_open"}


def test_links_and_modules_resolve():
  """Relative links of README.md and docs/ point at files (and at headings there), and every
  `python -m MODULE` they name is a module of the repository (or installed)."""
  import importlib.util  # pylint: disable=import-outside-toplevel
  missing = []
  for path in docs_blocks.doc_files():
    text = path.read_text()
    for target in _LINK.findall(text):
      if re.match(r"[a-z]+:", target):
        continue
      file, _, anchor = target.partition("#")
      linked = path.parent / file if file else path
      if not linked.exists():
        missing.append(f"{path.name}: link {target}")
      elif anchor and linked.suffix == ".md" and anchor not in _anchors(linked):
        missing.append(f"{path.name}: link {target} (no such heading)")
    for module in set(_MODULE.findall(text)):
      top = module.split(".")[0]
      local = ROOT / pathlib.Path(*module.split("."))
      if (ROOT / top).is_dir():
        if not (local.with_suffix(".py").exists() or (local / "__init__.py").exists()):
          missing.append(f"{path.name}: python -m {module}")
      elif importlib.util.find_spec(top) is None:
        missing.append(f"{path.name}: python -m {module}")
  assert not missing, missing
