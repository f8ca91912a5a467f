"""The TUI's widgets, one module per panel. Each panel has ``show(frame)``, called by the app
on its refresh timer while the panel is visible."""
