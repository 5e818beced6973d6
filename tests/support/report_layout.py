"""Where a report's picture puts its text, measured by matplotlib's own renderer."""

from __future__ import annotations

from typing import Any


def text_outside(fig: Any) -> list[str]:
    """Each text ``fig`` draws (with its box, if it has one) that extends past the figure's
    edges, as ``'label': its extent``; drawn at the size the report saves it."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(fig)
    drawn = _drawn(fig, canvas)
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
    return outside


def narrowest_axes(fig: Any) -> float:
    """The width of the figure's narrowest chart, as a fraction of the figure's."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig).draw()
    return min(ax.get_position().width for ax in fig.axes)


def overlapping(fig: Any) -> list[str]:
    """Pairs of texts ``fig`` draws over each other (tick labels aside: matplotlib spaces
    those), as ``'one' / 'other'``."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(fig)
    drawn = _drawn(fig, canvas)
    renderer = canvas.get_renderer()
    ticks = {
        id(label) for ax in fig.axes for label in (*ax.get_xticklabels(), *ax.get_yticklabels())
    }
    boxes = []
    for text in drawn:
        if id(text) in ticks:
            continue
        box = text.get_window_extent(renderer)
        if text.get_bbox_patch() is not None:
            box = text.get_bbox_patch().get_window_extent(renderer)
        boxes.append((text.get_text(), box))
    return [
        f"{a[:40]!r} / {b[:40]!r}"
        for i, (a, one) in enumerate(boxes)
        for b, other in boxes[i + 1 :]
        if one.overlaps(other)
    ]


def _drawn(fig: Any, canvas: Any) -> list[Any]:
    """The texts a draw of ``fig`` on ``canvas`` draws: an axis keeps tick labels beyond its
    limits that it does not draw, and a hidden text is not drawn."""
    from matplotlib.text import Text

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
    assert drawn, "no text was drawn"
    return drawn
