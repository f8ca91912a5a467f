from textual.geometry import Region


def shown(widget) -> str:
    """The text a widget draws (its whole content, also the part scrolled out of view)."""
    return "\n".join(s.text for s in widget.render_lines(Region(0, 0, widget.size.width, widget.size.height)))
