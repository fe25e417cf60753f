"""The render -> generate -> derender pipeline, below HTTP.

Routes parse a body, call one function here and respond; everything about tokens, text and
sampling happens here or below. Nothing in this package imports FastAPI or Starlette: failures
are the domain errors of ``pipeline.errors``, mapped to HTTP by ``api.errors`` alone.
"""
