"""Modal screens: help, breakpoints, one request's detail, quit confirmation."""
