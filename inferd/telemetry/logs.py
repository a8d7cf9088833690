"""Logs in one format for every logger of the process (inferd's, uvicorn's): JSON, one object per line, or
text with a record's extra fields as key=value. Prompts, completions and keys are never passed to a logger."""
import json
import logging
import time

LOG_FORMATS = ("json", "text")
RESERVED = set(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {"message", "asctime", "color_message"}


def extra_fields(record: logging.LogRecord) -> dict:
    """What the caller passed as extra= (uvicorn's color_message, a copy of msg, left out)."""
    return {k: v for k, v in record.__dict__.items() if k not in RESERVED}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {"ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
               "level": record.levelname.lower(), "logger": record.name, "msg": record.getMessage()}
        out |= extra_fields(record)
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


class TextFormatter(logging.Formatter):
    def __init__(self):
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def formatMessage(self, record: logging.LogRecord) -> str:
        return super().formatMessage(record) + "".join(f" {k}={v}" for k, v in extra_fields(record).items())


def own_or_warning(record: logging.LogRecord) -> bool:
    """Below WARNING, inferd's own lines only: a library's INFO (uvicorn's start-up and shut-down lines, which
    uvicorn.run sets its own loggers' level for) shows with --log-level debug."""
    return record.levelno >= logging.WARNING or record.name == "inferd" or record.name.startswith("inferd.")


def setup_logging(level: str, fmt: str = "text") -> None:
    """The root logger's one handler; uvicorn's loggers propagate to it (uvicorn.run(log_config=None))."""
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    if level != "debug":
        handler.addFilter(own_or_warning)
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
    quiet = logging.DEBUG if level == "debug" else logging.WARNING
    logging.getLogger("httpx").setLevel(quiet)  # one line per upstream call is noise
    logging.getLogger("alembic").setLevel(quiet)  # "Context impl SQLiteImpl." on every command
