"""The OpenAPI document of an app whose routes parse their own JSON bodies (so that errors are
OpenAI's, never FastAPI's 422): the request models are added as the routes' request bodies."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

REF = "#/components/schemas/{model}"


def document_bodies(app: FastAPI, bodies: dict[str, type[BaseModel]]) -> None:
    """Make `app.openapi()` describe each POST path's body as its pydantic request model."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for path, model in bodies.items():
                body = model.model_json_schema(ref_template=REF)
                components.update(body.pop("$defs", {}))
                components[model.__name__] = body
                schema["paths"][path]["post"]["requestBody"] = {
                    "required": True,
                    "content": {"application/json": {"schema": {"$ref": REF.format(model=model.__name__)}}}}
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
