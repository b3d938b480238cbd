"""A plan you can see: :func:`render_plan_html` (:mod:`.page`) draws a plan over its graph as one HTML page."""

from dspark.placement.picture.layout import MAX_DRAWN_OPS
from dspark.placement.picture.page import render_plan_html

__all__ = ["MAX_DRAWN_OPS", "render_plan_html"]
