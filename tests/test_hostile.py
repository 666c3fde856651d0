"""Hold up, round 4: secrets in storage URLs, resources that run out, outputs that are not regular files, models whose
logits are not finite, consoles that cannot show the text, byte-order marks, an empty HOME, someone else's model
files (a pickle with a payload, remote code, unreadable checkpoints and tokenizers, unsafe or broken chat templates).
Each class at the CLI as a user runs it (exit code, at most 3 lines on stderr, no traceback, no secret, nothing changed
where it should not be), and each new function on its own."""

import errno
import json
import os
import re
import resource
import shutil
import signal
import stat
import subprocess
import sys
import threading
from pathlib import Path

import optuna
import pytest
import torch
from optuna.trial import TrialState

from conftest import tiny_gguf
from skipsearch.cli import main
from skipsearch.io.errors import RESOURCE_EXIT, NonFiniteLogits, ResourceExhausted, exhausted_resource, resource_error
from test_bad_input import snapshot
from test_export import fake_study

ROOT = Path(__file__).parent.parent
SMALL = ["--num-prompts", "2", "--max-new-tokens", "16", "--min-match", "0", "--no-progress", "--no-pruning",
         "--no-plots"]


def cli(argv, cwd, env=None, patch="", preexec_fn=None, timeout=300):
    """The command line in a process of its own, as a user runs it (`patch`: Python run before it, to stand in for
    the machine); what it printed is on the result. transformers 5.24's FutureWarning about `past_key_values` is
    another change's business: it is not counted among the command's lines."""
    code = f"import sys\n{patch}\nfrom skipsearch.cli import main\nsys.exit(main(sys.argv[1:]))"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore::FutureWarning", **(env or {})}
    return subprocess.run([sys.executable, "-c", code, *map(str, argv)], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout, preexec_fn=preexec_fn)


def clean(result, code, *messages):
    """The command exited `code` with at most 3 lines on stderr, no traceback, and said each of `messages`."""
    err = result.stderr.strip()
    assert result.returncode == code, (result.returncode, result.stdout[-2000:], err[-3000:])
    assert len(err.splitlines()) <= 3 and "Traceback" not in result.stdout + err, err
    for message in messages:
        assert message in err, err
    return err


def one_line(capsys, code, returned, *messages):
    """The in-process form of `clean`: `main` returned `code` and printed one error line."""
    err = capsys.readouterr().err.strip()
    assert returned == code and len(err.splitlines()) == 1 and "Traceback" not in err, err
    for message in messages:
        assert message in err, err
    return err


# 1. Secrets in storage URLs --------------------------------------------------------------------------------------

SECRET = "s3cr@t:/pw"
ENCODED = "s3cr%40t%3A%2Fpw"
URL_FORMS = {
    "user and password": f"postgresql+psycopg2://me:{ENCODED}@127.0.0.1:1/db",
    "password only": f"postgresql+psycopg2://:{ENCODED}@127.0.0.1:1/db",
    "password as a query parameter": f"postgresql+psycopg2://me@127.0.0.1:1/db?sslmode=disable&password={ENCODED}",
    "raw, not percent-encoded": "postgresql+psycopg2://me:hunter2secret@127.0.0.1:1/db",
    "a port that is not a number": f"postgresql+psycopg2://me:{ENCODED}@127.0.0.1:port/db",
    "no scheme": f"me:{ENCODED}@127.0.0.1/db",
}


def secrets_in(text):
    return [s for s in (SECRET, ENCODED, "hunter2secret", "s3cr") if s in text]


@pytest.mark.parametrize("url", URL_FORMS.values(), ids=URL_FORMS)
def test_redact_url_hides_every_form_of_a_password(url):
    from skipsearch.search.storage import redact_text, redact_url

    shown = redact_url(url)
    assert not secrets_in(shown) and "***" in shown and "127.0.0.1" in shown
    own = "hunter2secret" if "hunter2secret" in url else f"{SECRET} or {ENCODED}"  # as a driver might repeat it
    assert not secrets_in(redact_text(f"cannot connect to {url}: password {own} refused", url))


def test_redact_url_leaves_urls_without_secrets_alone():
    from skipsearch.search.storage import redact_text, redact_url

    for url in ("sqlite:///studies/x.db", "journal:studies/x.log", "postgresql://me@host/db?sslmode=require"):
        assert redact_url(url) == url and redact_text(f"at {url}", url) == f"at {url}"
    assert redact_text("no url", None) == "no url"


@pytest.mark.parametrize("command", ["export", "optimize"])
@pytest.mark.parametrize("url", URL_FORMS.values(), ids=URL_FORMS)
def test_a_storage_url_is_never_printed_with_its_secret(url, command, tmp_path, tiny_model_dir, capsys,
                                                         monkeypatch):
    monkeypatch.chdir(tmp_path)
    argv = [command, "--storage", url, "--studies-dir", str(tmp_path / "studies")]
    returned = main([*argv, "--model", str(tiny_model_dir), *SMALL] if command == "optimize" else argv)
    out, err = capsys.readouterr()
    assert returned == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert not secrets_in(out + err), err
    assert not list(tmp_path.rglob("*"))  # nothing written either


def test_a_study_reports_and_stores_its_storage_without_the_secret(tmp_path, tiny_model_dir):
    """A whole study on a URL carrying a password (SQLite ignores it): no output, log, repr or file has it."""
    url = f"sqlite:///{tmp_path}/study.db?password={ENCODED}"
    result = cli(["optimize", "--model", tiny_model_dir, "--storage", url, "--n-trials", "2", "--studies-dir",
                  tmp_path / "studies", *SMALL], cwd=tmp_path)
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr
    assert "password=***" in result.stdout and not secrets_in(result.stdout + result.stderr)
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert any(p.name == "best.json" for p in files)
    assert not [p for p in files if secrets_in(p.read_bytes().decode("utf-8", "replace"))]


def test_study_settings_repr_hides_the_password():
    from skipsearch.search.study import StudySettings

    text = repr(StudySettings(study_name="s", storage=URL_FORMS["password as a query parameter"]))
    assert "password=***" in text and not secrets_in(text) and "study_name='s'" in text


def test_storage_place_names_the_file_or_the_redacted_url(tmp_path):
    from optuna.storages.journal import JournalFileBackend

    from skipsearch.search.storage import make_storage, storage_place

    assert storage_place("sqlite:///studies/x.db?password=pw") == "study database 'studies/x.db'"
    assert storage_place("journal:studies/x.log") == "journal 'studies/x.log'"
    assert storage_place(URL_FORMS["user and password"]) == "storage 'postgresql+psycopg2://me:***@127.0.0.1:1/db'"
    assert storage_place(make_storage(f"sqlite:///{tmp_path}/x.db")) == f"study database '{tmp_path}/x.db'"
    journal = optuna.storages.JournalStorage(JournalFileBackend(str(tmp_path / "x.log")))
    assert storage_place(journal) == f"journal '{tmp_path}/x.log'"


# 2. Resources that run out ---------------------------------------------------------------------------------------

ALLOCATOR = "[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: not enough memory: you tried to allocate 8 GB"


@pytest.mark.parametrize("error, resource", [
    (OSError(errno.ENOSPC, "No space left on device"), "disk space"),
    (OSError(errno.EDQUOT, "Disk quota exceeded"), "disk quota"),
    (OSError(errno.EFBIG, "File too large"), "room under the file-size limit"),
    (__import__("sqlite3").OperationalError("database or disk is full"), "disk space"),
    (__import__("sqlite3").OperationalError("disk I/O error"), "disk space or room under the file-size limit"),
    (MemoryError(), "memory"),
    (RuntimeError(ALLOCATOR), "memory"),
    (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), "memory"),
], ids=["ENOSPC", "EDQUOT", "EFBIG", "sqlite full", "sqlite I/O", "MemoryError", "CPU allocator", "CUDA"])
def test_exhausted_resource_reads_every_kind_and_the_chains_around_it(error, resource):
    import sqlalchemy.exc

    assert exhausted_resource(error) == (resource, error)
    wrapped = sqlalchemy.exc.OperationalError("INSERT ...", {}, error)  # SQLAlchemy keeps the driver's as `orig`
    assert exhausted_resource(wrapped)[0] == resource
    try:
        try:
            raise error
        except Exception:
            raise AssertionError("Should not reach.")  # what Optuna raises when a trial cannot be told
    except AssertionError as chained:
        assert exhausted_resource(chained)[0] == resource


def test_exhausted_resource_ignores_messages_and_other_faults():
    assert exhausted_resource(ValueError("no space left on device")) is None  # an input's message, not a fault
    assert exhausted_resource(OSError(errno.EACCES, "Permission denied")) is None
    assert exhausted_resource(RuntimeError("shape mismatch")) is None
    assert exhausted_resource(None) is None
    assert resource_error(KeyError("x"), "writing x") is None


def test_resource_error_is_one_line_naming_what_and_where():
    import sqlalchemy.exc

    driver = __import__("sqlite3").OperationalError("database or disk is full")
    error = resource_error(sqlalchemy.exc.OperationalError("INSERT\n[SQL: ...]", {}, driver),
                           "writing study database 'x.db'", "free some")
    assert isinstance(error, ResourceExhausted)
    assert str(error) == "out of disk space: writing study database 'x.db' failed (database or disk is full); free some"
    assert resource_error(error, "elsewhere") is error  # the innermost place that named its file is kept


def test_ends_the_study_on_resources_and_non_finite_models_only():
    from skipsearch.search.worker import ends_the_study

    assert ends_the_study(MemoryError()) and ends_the_study(NonFiniteLogits("nan"))
    assert ends_the_study(OSError(errno.ENOSPC, "full"))
    assert not ends_the_study(RuntimeError("a bug in one skip set")) and not ends_the_study(None)


def _fsize_limit(size):
    def limit():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead of killing
        resource.setrlimit(resource.RLIMIT_FSIZE, (size, size))

    return limit


def test_a_file_size_limit_mid_study_ends_it_in_one_line_and_keeps_the_finished_trials(tiny_model_dir, tmp_path):
    """The study's SQLite file may not grow past its size: SQLite says "disk I/O error" (EFBIG underneath)."""
    storage, studies = f"sqlite:///{tmp_path}/study.db", tmp_path / "studies"
    argv = ["optimize", "--model", tiny_model_dir, "--storage", storage, "--studies-dir", studies, *SMALL]
    assert main([str(a) for a in [*argv, "--n-trials", "2"]]) == 0
    best = studies / "default" / "best.json"
    before = snapshot(studies)
    finished = len(optuna.load_study(study_name="default", storage=storage).get_trials(states=(TrialState.COMPLETE,)))
    result = cli([*argv, "--n-trials", "40"], cwd=tmp_path,
                 preexec_fn=_fsize_limit((tmp_path / "study.db").stat().st_size))
    err = clean(result, RESOURCE_EXIT, "out of disk space or room under the file-size limit: writing study database "
                f"'{tmp_path}/study.db' failed (disk I/O error); the trials that finished are kept")
    assert len(err.splitlines()) == 1
    study = optuna.load_study(study_name="default", storage=storage)
    complete = study.get_trials(states=(TrialState.COMPLETE,))
    assert finished <= len(complete) < 40 and len(study.get_trials(states=(TrialState.FAIL,))) <= 1
    assert snapshot(studies) == before and best.is_file()  # neither exported nor plotted


def test_a_file_size_limit_on_an_output_names_the_output_and_keeps_the_old_file(tmp_path):
    fake_study(tmp_path, [1.0, 1.2])
    output = tmp_path / "out.json"
    output.write_text("old\n")
    result = cli(["export", "--study-name", "fake", "--storage", f"sqlite:///{tmp_path}/fake.db", "--output", output],
                 cwd=tmp_path, preexec_fn=_fsize_limit(64))
    clean(result, RESOURCE_EXIT, f"out of room under the file-size limit: writing '{output}' failed (File too large)")
    assert output.read_text() == "old\n" and sorted(p.name for p in tmp_path.iterdir()) == ["fake.db", "out.json"]


MEMORY_FREE = "import skipsearch.io.resources as r\nr.free_memory = lambda device: 40_000  # bytes: less than the cache"


@pytest.mark.parametrize("command", ["generate", "optimize"])
def test_a_cache_the_memory_cannot_hold_is_refused_before_any_work(command, tiny_model_dir, tmp_path):
    argv = ["--model", tiny_model_dir, "--max-new-tokens", "200"]
    argv = [command, "--prompt", "hi", *argv] if command == "generate" else \
        [command, *argv, "--num-prompts", "1", "--studies-dir", tmp_path / "studies", "--no-progress"]
    result = cli(argv, cwd=tmp_path, patch=MEMORY_FREE)
    err = clean(result, RESOURCE_EXIT, "out of memory: the KV cache for ", "on cpu, and 39.1 KiB is free; decode "
                                       "fewer new tokens (--max-new-tokens)")
    assert len(err.splitlines()) == 1 and not list(tmp_path.iterdir())


def test_the_cache_checks_its_memory_before_it_allocates(monkeypatch):
    from conftest import tiny_model
    from skipsearch.decode import kvcache
    from skipsearch.io import resources

    model = tiny_model()  # 4 layers, 2 key/value heads of 8, float32: 512 bytes a token
    assert kvcache.cache_bytes(model.config, 100, torch.float32) == 2 * 4 * 2 * 8 * 100 * 4
    assert kvcache.cache_bytes(model.config, 100, torch.bfloat16) == 2 * 4 * 2 * 8 * 100 * 2
    monkeypatch.setattr(resources, "free_memory", lambda device: 51_199)
    with pytest.raises(ResourceExhausted, match=r"the KV cache for 100 tokens needs 50.0 KiB on cpu, and 50.0 KiB"):
        kvcache.SpeculativeCache(model.config, 100, "cpu", torch.float32)
    kvcache.SpeculativeCache(model.config, 99, "cpu", torch.float32)  # fits
    with pytest.raises(ResourceExhausted, match="out of memory"):
        kvcache.check_cache_memory(model, 100)
    monkeypatch.setattr(resources, "free_memory", lambda device: None)  # unknown: not checked
    kvcache.check_cache_memory(model, 10**9)


def test_free_memory_reads_the_device():
    from skipsearch.io.resources import check_memory, free_memory, size_text

    cpu = torch.device("cpu")
    free = free_memory(cpu)
    assert free is None or 0 < free < 2**50
    assert free_memory(torch.device("meta")) is None  # not readable: no check
    check_memory(0, cpu, "nothing", "")
    if free is not None:
        with pytest.raises(ResourceExhausted, match=r"out of memory: a test needs .* on cpu, and .* is free; less"):
            check_memory(free + 2**30, cpu, "a test", "less")
    assert [size_text(n) for n in (100, 10_240, 3 * 2**20, 3 * 2**30)] == ["100 bytes", "10.0 KiB", "3.0 MiB",
                                                                            "3.00 GiB"]


def test_an_allocator_error_mid_study_ends_it_in_one_line(tiny_model_dir, tmp_path):
    """The allocator's error in the second decoded trial: the study ends there (no failed trial after failed trial,
    each with Optuna's traceback), exits RESOURCE_EXIT, and keeps the trials that finished."""
    patch = ("from skipsearch.search.evaluation import Evaluator\nreal, calls = Evaluator.evaluate, []\n"
             "def evaluate(self, *a, **k):\n    calls.append(1)\n"
             f"    if len(calls) == 2:\n        raise RuntimeError({ALLOCATOR!r})\n    return real(self, *a, **k)\n"
             "Evaluator.evaluate = evaluate")
    storage = f"sqlite:///{tmp_path}/study.db"
    result = cli(["optimize", "--model", tiny_model_dir, "--storage", storage, "--n-trials", "10", "--studies-dir",
                  tmp_path / "studies", *SMALL], cwd=tmp_path, patch=patch)
    err = clean(result, RESOURCE_EXIT, "out of memory: decoding on cpu failed (", "DefaultCPUAllocator",
                "the trials that finished are kept")
    assert len(err.splitlines()) == 1
    study = optuna.load_study(study_name="default", storage=storage)
    [failed] = study.get_trials(states=(TrialState.FAIL,))
    assert "not enough memory" in failed.user_attrs["fail_reason"]
    assert all(t.state == TrialState.WAITING for t in study.trials[failed.number + 1:])  # queued warm starts, not run
    assert not (tmp_path / "studies" / "default").exists()


def test_an_allocator_error_while_decoding_is_one_line(tiny_model_dir, capsys, monkeypatch):
    from skipsearch.decode import kvcache

    def cannot(*args, **kwargs):
        raise RuntimeError(ALLOCATOR)

    monkeypatch.setattr(kvcache.SpeculativeCache, "early_initialization", cannot)
    one_line(capsys, RESOURCE_EXIT, main(["generate", "--model", str(tiny_model_dir), "--prompt", "hi"]),
             "out of memory: `generate` failed ([enforce fail")


@pytest.mark.parametrize("error, shown", [(OSError(errno.ENOSPC, "No space left on device"), False),
                                          (RuntimeError("a bug"), True)], ids=["disk full", "a bug"])
def test_a_thread_that_meets_a_full_disk_prints_no_traceback(error, shown, capsys, monkeypatch):
    """Optuna's heartbeat thread writes the storage too: its resource error is the main thread's to report."""
    from skipsearch import cli

    def in_a_thread(args):
        thread = threading.Thread(target=lambda: (_ for _ in ()).throw(error))
        thread.start()
        thread.join()
        return 0

    handed_on = []  # what Python's hook (pytest's, here) is given to print
    monkeypatch.setattr(threading, "excepthook", lambda args: handed_on.append(args.exc_value))
    monkeypatch.setattr(cli, "cmd_plot", in_a_thread)
    assert main(["plot"]) == 0
    assert handed_on == ([error] if shown else [])


# 3. Outputs that are not regular files ---------------------------------------------------------------------------

def _export(tmp_path, output):
    if not (tmp_path / "fake.db").exists():
        fake_study(tmp_path, [1.0, 1.2])
    return main(["export", "--study-name", "fake", "--storage", f"sqlite:///{tmp_path}/fake.db", "--output",
                 str(output)])


def test_export_through_a_symlink_to_a_fifo_writes_the_stream_and_keeps_the_link(tmp_path, capsys):
    fifo, link = tmp_path / "pipe", tmp_path / "best.json"
    os.mkfifo(fifo)
    link.symlink_to(fifo)
    received = []
    reader = threading.Thread(target=lambda: received.append(fifo.read_text()))
    reader.start()
    assert _export(tmp_path, link) == 0
    reader.join(timeout=30)
    assert json.loads(received[0])["format"] == "skipsearch/skip-config"
    assert link.is_symlink() and stat.S_ISFIFO(fifo.stat().st_mode)
    assert f"exported {link}" in capsys.readouterr().out


def test_export_onto_a_character_device_writes_through_it(tmp_path, capsys):
    null = tmp_path / "null"
    try:
        os.mknod(null, stat.S_IFCHR | 0o666, os.makedev(1, 3))  # /dev/null's numbers, in a folder of the test's own
    except PermissionError:
        pytest.skip("this machine does not let the tests make a device node")
    assert _export(tmp_path, null) == 0
    assert stat.S_ISCHR(null.stat().st_mode)  # still the device, not a file put in its place
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fake.db", "null"]


def test_export_to_a_link_to_dev_stdout_reaches_stdout(tmp_path):
    """As the issue ran it, but through a link of the test's own: were the link replaced, /dev/stdout is not."""
    fake_study(tmp_path, [1.0, 1.2])
    link = tmp_path / "stdout"
    link.symlink_to("/dev/stdout")
    result = cli(["export", "--study-name", "fake", "--storage", f"sqlite:///{tmp_path}/fake.db", "--output", link],
                 cwd=tmp_path)
    clean(result, 0)
    assert '"format": "skipsearch/skip-config"' in result.stdout and f"exported {link}" in result.stdout
    assert link.is_symlink()


@pytest.mark.parametrize("output", ["/dev/stdout", "/proc/self/fd/1", "{log}"])
def test_export_to_stdout_redirected_to_a_file_appends_to_what_it_holds(tmp_path, output):
    """As `(echo before; python -m skipsearch export --output /dev/stdout; echo after) > log.txt` runs it: each of
    these names the file stdout is open on, which is written at stdout's position, never replaced."""
    fake_study(tmp_path, [1.0, 1.2])
    log = tmp_path / "log.txt"
    output = output.replace("{log}", str(log))
    code = "import sys\nfrom skipsearch.cli import main\nsys.exit(main(sys.argv[1:]))"
    argv = ["export", "--study-name", "fake", "--storage", f"sqlite:///{tmp_path}/fake.db", "--output", output]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore::FutureWarning"}
    shared = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)  # one open file, as the shell's `>` gives
    try:
        os.write(shared, b"before\n")
        result = subprocess.run([sys.executable, "-c", code, *argv], cwd=tmp_path, env=env, stdout=shared,
                                stderr=subprocess.PIPE, text=True, timeout=300)
        os.write(shared, b"after\n")
    finally:
        os.close(shared)
    assert result.returncode == 0, result.stderr
    text = log.read_text()
    assert text.startswith("before\n{") and text.endswith("after\n"), text
    exported, end = json.JSONDecoder().raw_decode(text, len("before\n"))  # the config, whole, then what it printed
    assert exported["format"] == "skipsearch/skip-config" and f"\nexported {output}: " in text[end:], text
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fake.db", "log.txt"]


def test_export_through_a_symlink_to_a_file_replaces_the_file_and_keeps_the_link(tmp_path, capsys):
    target, link = tmp_path / "real" / "best.json", tmp_path / "best.json"
    target.parent.mkdir()
    target.write_text("old\n")
    link.symlink_to(target)
    assert _export(tmp_path, link) == 0
    assert link.is_symlink() and json.loads(target.read_text())["format"] == "skipsearch/skip-config"
    assert sorted(p.name for p in target.parent.iterdir()) == ["best.json"]  # no temp file left


def test_an_output_that_is_neither_file_nor_stream_is_refused(tmp_path, capsys):
    from skipsearch.io.files import output_target, write_atomic

    block = tmp_path / "disk"
    try:
        os.mknod(block, stat.S_IFBLK | 0o600, os.makedev(7, 0))
    except PermissionError:
        pytest.skip("this machine does not let the tests make a device node")
    fake_study(tmp_path, [1.0, 1.2])
    before = snapshot(tmp_path)
    one_line(capsys, 2, _export(tmp_path, block), "--output", "is a block device: name a file")
    with pytest.raises(ValueError, match="is a block device"):
        write_atomic(block, "{}")
    assert stat.S_ISBLK(block.stat().st_mode) and snapshot(tmp_path) == before
    assert output_target(tmp_path / "new.json") == (tmp_path / "new.json", False)


def test_write_output_writes_a_stream_whole_and_only_after_the_writer_succeeds(tmp_path):
    from skipsearch.io.files import output_target, write_output

    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    assert output_target(fifo) == (fifo, True)
    with pytest.raises(RuntimeError, match="half"):  # nothing is sent: the FIFO is not even opened
        write_output(fifo, lambda tmp: (tmp.write_text("half"), (_ for _ in ()).throw(RuntimeError("half"))))
    received = []
    reader = threading.Thread(target=lambda: received.append(fifo.read_bytes()))
    reader.start()
    write_output(fifo, lambda tmp: tmp.write_bytes(b"\x89PNG whole"))
    reader.join(timeout=30)
    assert received == [b"\x89PNG whole"] and sorted(p.name for p in tmp_path.iterdir()) == ["pipe"]


def test_write_output_reports_a_full_disk_naming_the_output(tmp_path, monkeypatch):
    from skipsearch.io.files import write_output

    def full(tmp):
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp))

    with pytest.raises(ResourceExhausted, match=f"out of disk space: writing '{tmp_path}/best.json' failed"):
        write_output(tmp_path / "best.json", full)
    assert not list(tmp_path.iterdir())


# 4. Models whose logits are not finite ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def nan_model_dir(tmp_path_factory, tiny_model_dir):
    """The tiny model with one NaN weight in one MLP: every logit is NaN."""
    from safetensors.torch import load_file, save_file

    folder = tmp_path_factory.mktemp("nan-model")
    shutil.copytree(tiny_model_dir, folder, dirs_exist_ok=True)
    weights = load_file(folder / "model.safetensors")
    weights["model.layers.1.mlp.down_proj.weight"][0, 0] = float("nan")
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


@pytest.mark.parametrize("options", [[], ["--do-sample"], ["--autoregressive"]], ids=["greedy", "sampling", "plain"])
def test_generate_refuses_a_model_with_non_finite_logits(options, nan_model_dir, capsys):
    returned = main(["generate", "--model", str(nan_model_dir), "--prompt", "hi", "--skip-attn", "1", *options]
                    if "--autoregressive" not in options else
                    ["generate", "--model", str(nan_model_dir), "--prompt", "hi", *options])
    err = one_line(capsys, 2, returned, f"model '{nan_model_dir}' gives non-finite logits (NaN or inf)")
    assert "acceptance" not in err + capsys.readouterr().out


def test_a_study_on_a_model_with_non_finite_logits_ends_before_any_trial(nan_model_dir, tmp_path):
    storage = f"sqlite:///{tmp_path}/study.db"
    result = cli(["optimize", "--model", nan_model_dir, "--storage", storage, "--n-trials", "4", "--studies-dir",
                  tmp_path / "studies", *SMALL], cwd=tmp_path)
    err = clean(result, 2, f"model '{nan_model_dir}' gives non-finite logits")
    assert len(err.splitlines()) == 1 and not result.stdout.strip()
    study = optuna.load_study(study_name="default", storage=storage)  # the warm starts queued, nothing measured:
    assert {t.state for t in study.trials} == {TrialState.WAITING}  # no figure, not even plain decoding's
    assert not (tmp_path / "studies" / "default").exists()


def test_check_finite_is_asked_once_per_call_and_reads_nothing_of_its_own(monkeypatch):
    """The answer comes back with the prefill's first token, in its one host read: never per decoded token."""
    from conftest import tiny_model
    from skipsearch.decode import loop as decoding
    from skipsearch.decode.skipset import SkipSet

    model, calls = tiny_model(), []
    real = decoding.check_finite
    monkeypatch.setattr(decoding, "check_finite", lambda model, finite: (calls.append(finite), real(model, finite)))
    out = decoding.generate(model, [5, 9, 14], skip=SkipSet.of([1], [], 4), max_new_tokens=12)
    assert len(out.tokens) == 12 and calls == [True]
    with pytest.raises(NonFiniteLogits, match=r"model .* gives non-finite logits .* overflow in float32"):
        real(model, False)
    with torch.no_grad():
        model.lm_head.weight[3, 0] = float("inf")  # one logit of many
    for sampling in (decoding.Sampling(), decoding.Sampling(do_sample=True)):
        with pytest.raises(NonFiniteLogits):
            decoding.generate(model, [5, 9, 14], max_new_tokens=4, sampling=sampling)
    assert calls[1:] == [False, False]


# 5. A console that cannot show the text --------------------------------------------------------------------------

def test_an_ascii_console_gets_the_summary_and_the_files_stay_utf8(tiny_model_dir, tmp_path):
    dataset, studies = tmp_path / "données.jsonl", tmp_path / "études"
    dataset.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("Écris un poème 🌸", "Grüße, café?")),
                       encoding="utf-8")
    env = {"LC_ALL": "C", "LANG": "C", "PYTHONIOENCODING": "ascii"}
    result = cli(["optimize", "--model", tiny_model_dir, "--dataset", dataset, "--n-trials", "2", "--studies-dir",
                  studies, "--study-name", "s", *SMALL], cwd=tmp_path, env=env)
    clean(result, 0)
    assert "exported " in result.stdout and "?tudes" in result.stdout  # the study's folder, shown as ASCII can
    config = json.loads((studies / "s" / "best.json").read_text(encoding="utf-8"))
    assert "données.jsonl" in config["search"]["dataset"]
    result = cli(["generate", "--model", tiny_model_dir, "--prompt", "Grüße 🌸", "--max-new-tokens", "4"],
                 cwd=tmp_path, env=env)
    clean(result, 0)
    assert "4 tokens" in result.stderr


# 6. A byte-order mark --------------------------------------------------------------------------------------------

BOM = "\ufeff"


def test_json_and_jsonl_files_with_a_byte_order_mark_are_read(tmp_path, tiny_model_dir, capsys):
    from transformers import AutoModelForCausalLM

    from skipsearch.decode.config import ModelInfo, SkipConfig, save_skip_config
    from skipsearch.decode.skipset import SkipSet
    from skipsearch.io.files import read_json

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    save_skip_config(SkipConfig(model=ModelInfo.of(model, "tiny"), skip=SkipSet.of([1], [], 4)), tmp_path / "c.json")
    config = tmp_path / "c.json"
    config.write_text(BOM + config.read_text(), encoding="utf-8")  # as Notepad saves it
    (tmp_path / "p.jsonl").write_text(BOM + '{"prompt": "one"}\n{"prompt": "two"}\n', encoding="utf-8")
    (tmp_path / "p.json").write_text(BOM + '[{"prompt": "one"}, {"prompt": "two"}]', encoding="utf-8")
    assert read_json(config, "skip config")["format"] == "skipsearch/skip-config"
    assert read_json(tmp_path / "p.jsonl", "dataset", lines=True) == [(1, {"prompt": "one"}), (2, {"prompt": "two"})]
    assert main(["generate", "--model", str(tiny_model_dir), "--prompt", "hi", "--config", str(config),
                 "--max-new-tokens", "4"]) == 0
    assert "skip attn=[1]" in capsys.readouterr().err
    for dataset in ("p.jsonl", "p.json"):
        assert main(["optimize", "--model", str(tiny_model_dir), "--dataset", str(tmp_path / dataset),
                     "--n-trials", "1", "--confirm-top", "0", "--warm-start", str(config), "--study-name",
                     dataset.replace(".", "-"), "--studies-dir", str(tmp_path / "studies"), *SMALL]) == 0
    assert "warm starts: " in capsys.readouterr().out


def test_a_model_folder_file_with_a_byte_order_mark_is_named(tmp_path, tiny_model_dir, capsys):
    """transformers reads a model folder's JSON files itself and cannot read past the mark: one line names the file."""
    folder = tmp_path / "model"
    shutil.copytree(tiny_model_dir, folder)
    config = folder / "config.json"
    config.write_bytes(BOM.encode() + config.read_bytes())
    one_line(capsys, 2, main(["generate", "--model", str(folder), "--prompt", "hi"]),
             "config.json start(s) with a UTF-8 byte-order mark, which transformers cannot read")


# 7. An empty HOME ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("home", ["", "relative/home"], ids=["empty", "relative"])
def test_an_unusable_home_is_refused_before_any_cache_is_made(home, tmp_path):
    root_cache = Path("/.cache")
    before = snapshot(root_cache) if root_cache.exists() else None
    env = {"HOME": home, "SKIPSEARCH_CACHE": "", "XDG_CACHE_HOME": "", "HF_HOME": "", "MPLCONFIGDIR": ""}
    result = cli(["generate", "--prompt", "hi"], cwd=tmp_path, env=env)
    err = clean(result, 2, f"HOME is {'empty' if not home else 'relative'}", "set HOME to your home folder")
    assert len(err.splitlines()) == 1
    assert (snapshot(root_cache) if root_cache.exists() else None) == before and not list(tmp_path.iterdir())


def test_home_folder_and_the_cache_refuse_an_empty_home(monkeypatch):
    from skipsearch.io import models
    from skipsearch.io.files import home_folder

    monkeypatch.delenv("SKIPSEARCH_CACHE", raising=False)
    monkeypatch.setenv("HOME", "/home/someone")
    assert home_folder() == Path("/home/someone") and models.cache_dir() == Path("/home/someone/.cache/skipsearch")
    for home in ("", "rel"):
        monkeypatch.setenv("HOME", home)
        with pytest.raises(ValueError, match="HOME is .*: the caches kept under ~/.cache"):
            models.cache_dir()
    monkeypatch.setenv("SKIPSEARCH_CACHE", "/elsewhere")
    assert models.cache_dir() == Path("/elsewhere")  # named outright: HOME is not asked
    monkeypatch.delenv("HOME")
    assert home_folder().is_absolute()  # unset: the password database's home, as Path.home() gives


# 8. Someone else's model files: a pickle with a payload, remote code, unreadable checkpoints and tokenizers, chat
# templates that are unsafe or broken, a GGUF file transformers cannot convert -----------------------------------

class _Payload:
    """A pickle that would create a marker file if it were ever unpickled with its code."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _edit_json(path, **changes):
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def _pickled_payload(folder):
    (folder / "model.safetensors").unlink()
    torch.save({"model.embed_tokens.weight": _Payload(folder.parent / "PAYLOAD-RAN")}, folder / "pytorch_model.bin")


HOSTILE_FOLDERS = {  # name: (how to spoil a copy of the tiny model, what the one line says)
    "pickle-payload": (_pickled_payload, r"pytorch_model.bin' was refused: it is a pickle that would call \S*system"),
    "pickle-garbage": (lambda f: ((f / "model.safetensors").unlink(), (f / "pytorch_model.bin").write_bytes(b"x" * 99)),
                       "pytorch_model.bin' was refused: it does not unpickle as weights only"),
    "remote-config": (lambda f: _edit_json(f / "config.json", model_type="evil", auto_map={
        "AutoConfig": "evil.EvilConfig", "AutoModelForCausalLM": "evil.EvilModel"}),
        "config.json' names remote code \\(model_type 'evil', from evil.EvilConfig, evil.EvilModel\\)"),
    # A type transformers knows, but not as a causal LM: only the folder's own class would build one.
    "remote-model-class": (lambda f: (_edit_json(f / "config.json", model_type="t5", auto_map={
        "AutoModelForCausalLM": "evil.EvilModel"}), (f / "evil.py").write_text(
            f"open({str(f.parent / 'PAYLOAD-RAN')!r}, 'w').close()\nclass EvilModel: pass\n")),
        "config.json' names remote code \\(model_type 't5', from evil.EvilModel\\)"),
    "remote-tokenizer": (lambda f: _edit_json(f / "tokenizer_config.json", tokenizer_class="EvilTokenizer",
                                              auto_map={"AutoTokenizer": ["evil.EvilTokenizer", None]}),
                         "tokenizer_config.json' names remote code"),
    "other-format": (lambda f: ((f / "model.safetensors").unlink(), (f / "tf_model.h5").write_bytes(b"x"),
                                (f / "consolidated.00.pth").write_bytes(b"x")),
                     "has no checkpoint transformers reads .*only consolidated.00.pth, tf_model.h5"),
    "tokenizer-unparsed": (lambda f: (f / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "?"}}'),
                           "tokenizer.json' does not parse as a tokenizer"),
    "unsafe-template": (lambda f: (f / "chat_template.jinja").write_text(
        "{{ ''.__class__.__mro__[1].__subclasses__() }}"), "chat_template.jinja' reaches for what jinja's sandbox"),
    "broken-template": (lambda f: (f / "chat_template.jinja").write_text("{% for m in messages %}"),
                        "chat_template.jinja' does not parse"),
}
# Which commands read what: every command loads the config; all but check-family the weights and tokenizer; the
# commands that encode prompts the chat template.
_READERS = {"config": ("generate", "optimize", "bench", "profile", "check-family"),
            "weights": ("generate", "optimize", "bench", "profile"), "template": ("generate", "optimize", "bench")}
_READS = {"remote-config": "config", "remote-model-class": "config", "unsafe-template": "template", "broken-template": "template"}
LOADING_CASES = [(name, command) for name in HOSTILE_FOLDERS for command in _READERS[_READS.get(name, "weights")]]


@pytest.fixture(scope="module")
def hostile_models(tmp_path_factory, tiny_model_dir):
    root = tmp_path_factory.mktemp("hostile")
    for name, (spoil, _) in HOSTILE_FOLDERS.items():
        shutil.copytree(tiny_model_dir, root / name)
        spoil(root / name)
    return root


def _command_argv(command, model, tmp_path):
    return {"generate": ["generate", "--model", model, "--prompt", "hi"],
            "optimize": ["optimize", "--model", model, "--n-trials", "1", "--studies-dir", tmp_path / "studies",
                         *SMALL],
            "bench": ["bench", "--model", model, "--num-prompts", "1", "--repeats", "1", "--no-progress",
                      "--studies-dir", tmp_path / "studies"],
            "profile": ["profile", "--model", model, "--studies-dir", tmp_path / "studies", "--no-progress"],
            "check-family": ["check-family", "--model", model, "--no-compile"]}[command]


@pytest.mark.parametrize("name, command", LOADING_CASES, ids=[f"{n}-{c}" for n, c in LOADING_CASES])
def test_someone_elses_model_files_end_in_one_line(name, command, hostile_models, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("builtins.input", lambda *_: "y")  # were transformers to ask whether to run the folder's code
    folder = hostile_models / name
    before = snapshot(hostile_models)
    returned = main([str(a) for a in _command_argv(command, str(folder), tmp_path)])
    err = capsys.readouterr().err.strip()
    assert returned == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert re.search(HOSTILE_FOLDERS[name][1], err) and str(folder) in err, err
    assert not list(tmp_path.iterdir())  # nothing written: no study, no profile, no output
    assert snapshot(hostile_models) == before and not (hostile_models / "PAYLOAD-RAN").exists()


@pytest.mark.parametrize("name", [n for n in HOSTILE_FOLDERS if _READS.get(n) != "template"])
def test_the_api_refuses_someone_elses_model_files_naming_the_file(name, hostile_models):
    from skipsearch.io.models import load_model

    with pytest.raises(ValueError, match=HOSTILE_FOLDERS[name][1]):
        load_model(hostile_models / name, device="cpu")
    assert not (hostile_models / "PAYLOAD-RAN").exists()


@pytest.mark.parametrize("name", ["unsafe-template", "broken-template"])
def test_the_api_refuses_an_unsafe_or_broken_chat_template_naming_the_file(name, hostile_models):
    from skipsearch.api.generate import GenerateSettings, generate_text

    with pytest.raises(ValueError, match=HOSTILE_FOLDERS[name][1]):
        generate_text(GenerateSettings(model=str(hostile_models / name), prompt="hi", device="cpu"))
    # The template is not needed for raw prompts: the model itself loads and decodes.
    assert generate_text(GenerateSettings(model=str(hostile_models / name), prompt="hi", raw=True, device="cpu",
                                          max_new_tokens=2)).text is not None


def test_a_payload_never_runs_even_where_the_loader_is_asked_twice(hostile_models, monkeypatch):
    """The diagnosis of a refused checkpoint unpickles it again, still weights only: torch.load is never asked
    for anything else."""
    from skipsearch.io.models import load_model

    real, asked = torch.load, []
    monkeypatch.setattr(torch, "load", lambda *a, **k: (asked.append(k.get("weights_only")), real(*a, **k))[1])
    with pytest.raises(ValueError, match="was refused"):
        load_model(hostile_models / "pickle-payload", device="cpu")
    assert asked and all(flag is True for flag in asked) and not (hostile_models / "PAYLOAD-RAN").exists()


@pytest.mark.parametrize("architecture", ["evil", "llama"])
def test_a_gguf_file_transformers_cannot_convert_is_one_line(architecture, tmp_path, capsys, monkeypatch):
    """An architecture transformers does not convert, and a llama file with no tokenizer and missing metadata: the
    GGUF file is named, and no converted folder is cached."""
    from skipsearch.io.models import load_model

    monkeypatch.setenv("SKIPSEARCH_CACHE", str(tmp_path / "cache"))
    gguf = tmp_path / f"{architecture}.gguf"
    tiny_gguf(gguf, architecture)
    returned = main(["generate", "--model", str(gguf), "--prompt", "hi"])
    err = capsys.readouterr().err  # besides the conversion's progress bar, which transformers draws itself
    errors = [line for line in err.splitlines() if "error:" in line]
    assert returned == 2 and len(errors) == 1 and "Traceback" not in err, err
    assert f"cannot convert GGUF file '{gguf}'" in errors[0], err
    with pytest.raises(ValueError, match=f"cannot convert GGUF file '{gguf}'"):
        load_model(gguf, device="cpu")
    assert not list((tmp_path / "cache" / "models").glob("*[!.]*"))


def test_load_error_keeps_resources_and_faults_of_the_machine():
    from skipsearch.io.refusals import load_error

    full, unreadable = OSError(errno.ENOSPC, "No space left on device"), PermissionError(errno.EACCES, "denied", "f")
    assert load_error(full, "x") is full and load_error(unreadable, "x") is unreadable
    assert load_error(MemoryError(), "x").__class__ is MemoryError
    for error in (Exception("rust"), KeyError("added_tokens"), OSError("Can't load tokenizer"), RuntimeError("zip")):
        refused = load_error(error, "the one line")
        assert type(refused) is ValueError and str(refused) == "the one line"


def test_remote_code_is_named_only_where_transformers_would_need_it(tmp_path, tiny_model_dir):
    from skipsearch.io.refusals import remote_code

    folder = tmp_path / "model"
    shutil.copytree(tiny_model_dir, folder)
    assert remote_code(folder) is None
    _edit_json(folder / "config.json", auto_map={"AutoModelForCausalLM": "own.Model"})  # llama: transformers' own
    assert remote_code(folder) is None
    _edit_json(folder / "config.json", model_type="t5")  # known, but as no causal LM: only own.Model builds one
    assert "config.json' names remote code (model_type 't5', from own.Model)" in remote_code(folder)
    _edit_json(folder / "config.json", auto_map={"AutoModel": "own.Model"})  # no causal LM class of its own
    assert remote_code(folder) is None
    _edit_json(folder / "config.json", model_type="evil")
    assert "config.json' names remote code (model_type 'evil', from own.Model)" in remote_code(folder)


def test_a_config_built_with_random_weights_never_runs_the_folders_code(tmp_path, tiny_model_dir, monkeypatch):
    """`profile --config-only` and check-family build from the config alone: a known type that is no causal LM, with
    a class of the folder's own, is refused even past remote_code's check, and transformers never gets to ask."""
    from transformers import AutoConfig

    from skipsearch.decode.families import tiny_model
    from skipsearch.io.models import model_from_config

    folder = tmp_path / "model"
    shutil.copytree(tiny_model_dir, folder)
    HOSTILE_FOLDERS["remote-model-class"][0](folder)
    monkeypatch.setattr("builtins.input", lambda *_: "y")
    with pytest.raises(ValueError, match="names remote code"):
        model_from_config(str(folder))
    config = AutoConfig.from_pretrained(folder, trust_remote_code=False)
    with pytest.raises(ValueError, match="cannot build a causal LM") as refused:
        tiny_model(config)
    assert len(str(refused.value).splitlines()) == 1 and not (tmp_path / "PAYLOAD-RAN").exists()


def test_a_hub_models_refused_pickle_is_named_by_what_it_would_call():
    """A Hub model's files are in the Hub's cache: the refusal comes from the error's chain (raised as it is or
    wrapped), in skipsearch's words, not torch's first line, which advises loading the file unsafely."""
    import pickle

    from skipsearch.io.refusals import checkpoint_refusal

    refusal = pickle.UnpicklingError("Weights only load failed. \x1b[1mDo it unsafely\x1b[0m\n"
                                     "Unsupported global: GLOBAL posix.system was not an allowed global")
    try:
        try:
            raise refusal
        except pickle.UnpicklingError as error:
            raise OSError("Unable to load weights from pytorch checkpoint file") from error
    except OSError as wrapped:
        for error in (refusal, wrapped):
            why = checkpoint_refusal(Path("someone/model"), error)
            assert why.startswith("its pickled checkpoint was refused: it is a pickle that would call posix.system")
            assert "\x1b" not in why and "unsafely" not in why
    assert checkpoint_refusal(Path("someone/model"), KeyError("x")) == "cannot load its weights ('x')"


def test_only_checkpoint_files_are_unpickled_again_to_name_a_refusal(tmp_path, monkeypatch):
    """A Trainer's output holds training_args.bin, a pickle of its settings that transformers never loads: the
    diagnosis of a failed load must not blame it."""
    from skipsearch.io.refusals import checkpoint_refusal

    (tmp_path / "training_args.bin").write_bytes(b"not read")
    asked = []
    monkeypatch.setattr(torch, "load", lambda path, **_: asked.append(path.name))
    assert checkpoint_refusal(tmp_path, ValueError("size mismatch")).endswith("(size mismatch)") and asked == []
    (tmp_path / "pytorch_model.bin").write_bytes(b"x")
    checkpoint_refusal(tmp_path, ValueError("size mismatch"))
    assert asked == ["pytorch_model.bin"]


def test_checkpoint_format_and_template_source(tmp_path, default_model):
    from skipsearch.io.refusals import template_source, unreadable_checkpoint

    assert "no weights" in unreadable_checkpoint(tmp_path)
    (tmp_path / "flax_model.msgpack").write_bytes(b"x")
    assert "only flax_model.msgpack" in unreadable_checkpoint(tmp_path)
    (tmp_path / "pytorch_model-00001-of-00002.bin").write_bytes(b"x")
    assert unreadable_checkpoint(tmp_path) is None
    assert template_source(default_model.tokenizer).endswith("chat_template.jinja")
    assert template_source(type("T", (), {"name_or_path": str(tmp_path)})()) == str(tmp_path)


def _unreadable(path, monkeypatch):
    """Make `path` a file this process may not read: chmod 000, or, as root (whom chmod does not stop), an open()
    that answers what the kernel would."""
    if os.geteuid() != 0:
        path.chmod(0)
        return
    real_open = Path.open

    def denied(self, *args, **kwargs):
        if Path(self) == path:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
        return real_open(self, *args, **kwargs)

    monkeypatch.setattr(Path, "open", denied)


@pytest.mark.parametrize("name", ["config.json", "tokenizer.json", "model.safetensors"])
def test_a_model_file_that_cannot_be_read_is_the_machines_fault_not_damage(name, tmp_path, monkeypatch):
    """Permissions or an I/O error are no damaged download: the OSError is raised as it is (exit 1, naming the file),
    not a one-line 'download or convert the model again' (exit 2)."""
    from safetensors.torch import save_file

    from skipsearch.io import models

    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "tokenizer.json").write_text("{}")
    save_file({"weight": torch.zeros(2)}, folder / "model.safetensors")
    assert models.damaged_model_files(folder) is None
    _unreadable(folder / name, monkeypatch)
    with pytest.raises(PermissionError) as raised:
        models.damaged_model_files(folder)
    assert raised.value.errno == errno.EACCES and str(folder / name) in str(raised.value)


def test_a_dataset_that_cannot_be_read_is_the_machines_fault(tmp_path, monkeypatch, capsys):
    import argparse

    from skipsearch.cli.process import report
    from skipsearch.io.data import load_prompts
    from skipsearch.io.files import read_json

    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "a"}\n')
    _unreadable(path, monkeypatch)
    with pytest.raises(PermissionError) as raised:
        load_prompts(str(path), num_prompts=1)
    args = argparse.Namespace(prog="skipsearch optimize", command="optimize")
    assert report(args, raised.value) == 1
    assert capsys.readouterr().err == f"skipsearch optimize: error: Permission denied: {path}\n"
    with pytest.raises(ValueError, match="does not exist"):  # a path that names no file is still bad input
        read_json(tmp_path / "nope.json", "dataset")
    with pytest.raises(ValueError, match="cannot read dataset .*Not a directory"):
        read_json(path / "under-a-file.json", "dataset")


@pytest.mark.parametrize("fault, kept", [(OSError(errno.ENOSPC, "No space left on device"), OSError),
                                         (MemoryError(), MemoryError),
                                         (PermissionError(errno.EACCES, "Permission denied", "x"), PermissionError),
                                         (RuntimeError("the dataset's own complaint"), ValueError)])
def test_a_hub_dataset_download_keeps_the_machines_faults(fault, kept, monkeypatch):
    """A full disk or memory running out while datasets downloads is exit 3, not 2; its own errors are one line."""
    import datasets

    from skipsearch.io.data import load_prompts

    def load_dataset(*args, **kwargs):
        raise fault

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    monkeypatch.setattr("skipsearch.io.models.hub_unreachable", lambda: None)
    with pytest.raises(kept) as raised:
        load_prompts("someone/some-dataset")
    assert raised.value is fault or str(raised.value) == "cannot read dataset 'someone/some-dataset': the dataset's " \
                                                          "own complaint"
