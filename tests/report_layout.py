"""Where a report's picture puts its text, measured by matplotlib's own renderer."""

from __future__ import annotations

from typing import Any


def text_outside(fig: Any) -> list[str]:
    """Each text ``fig`` draws (with its box, if it has one) that extends past the figure's
    edges, as ``'label': its extent``; drawn at the size the report saves it. Only the texts
    drawn count: an axis keeps tick labels beyond its limits that it does not draw."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.text import Text

    canvas = FigureCanvasAgg(fig)
    drawn: list[Any] = []
    draw = Text.draw

    def recording(text: Any, renderer: Any) -> None:
        if text.get_visible() and text.get_text().strip():
            drawn.append(text)
        draw(text, renderer)

    Text.draw = recording  # type: ignore[method-assign]
    try:
        canvas.draw()
    finally:
        Text.draw = draw  # type: ignore[method-assign]
    renderer = canvas.get_renderer()
    frame = fig.bbox
    outside = []
    for text in drawn:
        extents = [text.get_window_extent(renderer)]
        if text.get_bbox_patch() is not None:
            extents.append(text.get_bbox_patch().get_window_extent(renderer))
        for box in extents:
            if (
                box.x0 < frame.x0 - 0.5
                or box.x1 > frame.x1 + 0.5
                or box.y0 < frame.y0 - 0.5
                or box.y1 > frame.y1 + 0.5
            ):
                outside.append(f"{text.get_text()[:60]!r}: {box.bounds} in {frame.bounds}")
    assert drawn, "no text was drawn"
    return outside


def narrowest_axes(fig: Any) -> float:
    """The width of the figure's narrowest chart, as a fraction of the figure's."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig).draw()
    return min(ax.get_position().width for ax in fig.axes)
