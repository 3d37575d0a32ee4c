"""How a run went, in words the examples print."""


def trend(name: str, first: float, last: float) -> str:
    """'NAME fell from A to B' or 'rose', as it happened ('went' when B is not a number)."""
    if last < first:
        verb = "fell"
    elif last > first:
        verb = "rose"
    elif last == first:
        return f"{name} stayed at {first:.4f}"
    else:
        verb = "went"
    return f"{name} {verb} from {first:.4f} to {last:.4f}"
