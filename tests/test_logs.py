import json
import logging

from inferd.telemetry.logs import JsonFormatter, TextFormatter


def record() -> logging.LogRecord:
    r = logging.LogRecord("inferd.gateway", logging.INFO, "", 0, "request %s", ("done",), None)
    r.__dict__.update(request_id="r1", status=200, color_message="\x1b[1mrequest done\x1b[0m")  # as extra= does
    return r


def test_text_lines_end_with_the_extra_fields():
    assert TextFormatter().format(record()).endswith(" INFO inferd.gateway: request done request_id=r1 status=200")


def test_json_lines_hold_the_extra_fields_but_not_uvicorns_color_copy():
    line = json.loads(JsonFormatter().format(record()))
    assert (line["msg"], line["request_id"], line["status"]) == ("request done", "r1", 200)
    assert "color_message" not in line


def test_commands_print_no_migration_lines_unless_debug(tmp_path):
    import subprocess
    import sys
    db = f"sqlite:///{tmp_path / 'db.sqlite'}"
    quiet = subprocess.run([sys.executable, "-m", "inferd.cli", "tenants", "list", "--db", db],
                           capture_output=True, text=True, timeout=60)
    assert quiet.returncode == 0 and "alembic" not in quiet.stderr + quiet.stdout


def test_library_info_lines_show_only_at_debug():
    from inferd.telemetry.logs import own_or_warning

    def line(name: str, level: int) -> logging.LogRecord:
        return logging.LogRecord(name, level, "", 0, "x", (), None)
    assert own_or_warning(line("inferd", logging.INFO)) and own_or_warning(line("inferd.gateway.access", logging.INFO))
    assert not own_or_warning(line("uvicorn.error", logging.INFO))  # "Started server process [...]"
    assert not own_or_warning(line("inferdx", logging.INFO)) and own_or_warning(line("uvicorn.error", logging.WARNING))


def test_serve_prints_no_library_info_line(smollm2_server):
    _, log_path = smollm2_server
    lines = [json.loads(line) for line in log_path.read_text().splitlines() if line.startswith("{")]
    assert lines and all(x["logger"].startswith("inferd") for x in lines if x["level"] in ("info", "debug")), \
        sorted({x["logger"] for x in lines if x["level"] == "info"})
