"""bench refuses a flag the measurement given does not read (it was accepted and ignored)."""

import pytest

from refusion_mlx import bench


@pytest.mark.parametrize("argv, message", [
    (["--layouts", "16", "--max-tokens", "8"], "--max-tokens does not go with --layouts"),
    (["--layouts", "16", "--slot-size", "8"], "--slot-size does not go with --layouts"),
    (["--layouts", "16", "--block-length", "8"], "--block-length does not go with --layouts"),
    (["--layouts", "16", "--serial-num-blocks", "2"], "--serial-num-blocks does not go with --layouts"),
    (["--layouts", "16", "--repeat", "3"], "--repeat does not go with --layouts"),
    (["--layouts", "16", "--no-chat-template"], "--no-chat-template does not go with --layouts"),
    (["--concurrency", "1", "--repeat", "5"], "--repeat does not go with --concurrency"),
    (["--concurrency", "1", "--warmup", "0"], "--warmup does not go with --concurrency"),
    (["--concurrency", "1", "--no-ar"], "--no-ar does not go with --concurrency"),
    (["--concurrency", "1", "--http", "--no-chat-template"], "--no-chat-template does not go with --http"),
    (["--conversation", "2", "--no-chat-template"], "--no-chat-template does not go with --conversation"),
    (["--conversation", "2", "--repeat", "2"], "--repeat does not go with --conversation"),
    (["--shape", "qwen3-0.6b", "--forecast-only", "--batch", "2"], "--batch does not go with --forecast-only"),
    (["--shape", "qwen3-0.6b", "--repeat", "2"], "--repeat does not go with --shape"),
])
def test_a_flag_the_measurement_does_not_read_is_refused(argv, message, capsys):
    assert message in refused(argv, capsys)


def refused(argv, capsys) -> str:
    """bench's usage error for ``argv``: exit 2, one line."""
    with pytest.raises(SystemExit) as e:
        bench.main(argv)
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1, err
    return err


def test_http_refuses_a_budget_past_the_context_as_in_process(tmp_path, capsys):
    """The server cut the budget to what the context leaves: --http measured 2,403 tokens and exited 0."""
    suite = tmp_path / "one.json"
    suite.write_text('{"prompts": [{"prompt": "Who is Sven?"}]}')
    lines = []
    for mode in ([], ["--http"]):
        assert bench.main(["--suite", str(suite), "--concurrency", "1", "--rounds", "1", "--max-tokens", "4000",
                           *mode]) == 1
        lines.append(capsys.readouterr().err.strip())
    assert lines[0] == lines[1] and "exceeds the model's context of 2048" in lines[0]
    assert len(lines[1].splitlines()) == 1


def test_the_report_never_overwrites_the_bundled_suite_or_the_package(tmp_path, capsys):
    """--json onto the bundled suite wrote over it, and every later run failed."""
    from pathlib import Path

    import refusion_mlx
    from refusion_mlx.bench.suite import DEFAULT_SUITE

    before = DEFAULT_SUITE.read_bytes()
    package = Path(refusion_mlx.__file__).parent
    for target, message in ((DEFAULT_SUITE, "is an input of this run"),
                            (package / "bench" / ".." / "bench" / "suite.json", "is an input of this run"),
                            (package / "report.json", "inside the installed refusion_mlx package")):
        assert message in refused(["--max-tokens", "8", "--no-ar", "--json", str(target)], capsys)
    assert DEFAULT_SUITE.read_bytes() == before and not (package / "report.json").exists()
