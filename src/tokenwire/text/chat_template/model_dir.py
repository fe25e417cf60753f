"""The chat template a local model directory ships."""

from __future__ import annotations

import json
from pathlib import Path


def load_model_chat_template(model_dir: Path) -> str | None:
    """The chat template a HF model directory ships, as transformers picks it.

    Template files win over ``tokenizer_config.json`` (transformers 5 saves them):
    ``chat_template.jinja``, else ``additional_chat_templates/default.jinja``; a list of named
    templates in the config gives its ``default`` entry. (transformers picks a ``tool_use``
    template instead when tools are passed; this returns the default one only.)
    """
    model_dir = Path(model_dir)
    for jinja_file in (
        model_dir / "chat_template.jinja",
        model_dir / "additional_chat_templates" / "default.jinja",
    ):
        if jinja_file.is_file():
            return jinja_file.read_text(encoding="utf-8")
    config_file = model_dir / "tokenizer_config.json"
    if config_file.is_file():
        template = json.loads(config_file.read_text(encoding="utf-8")).get("chat_template")
        if isinstance(template, str):
            return template
        if isinstance(template, list):
            named = {
                item.get("name"): item.get("template")
                for item in template
                if isinstance(item, dict)
            }
            default = named.get("default")
            return default if isinstance(default, str) else None
    return None
