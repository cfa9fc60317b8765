"""nvchat's colour themes: one TOML file per theme in this directory, turned into Textual themes.

A theme file holds Textual's theme fields (name, dark, primary, background, ...), an optional
[variables] table of Textual design variables, and `tab_colors`: the colours that tell
conversations apart (tab markers and the KV panel's block map). Dropping a new .toml file here is
all it takes to add a theme.
"""
import tomllib
from importlib import resources

from textual.theme import Theme

# Used for themes that name no tab colours (Textual's built-in ones): mid-tones that read on
# both light and dark backgrounds.
DEFAULT_TAB_COLORS = ("#3B9EDB", "#E0A030", "#A461D8", "#E0457B", "#2DB38A", "#E07030", "#6C7EE8", "#B8A800")

_TAB_COLOR_VARIABLE = "nvchat-tab-{}"
_THEME_FIELDS = {"name", "primary", "secondary", "warning", "error", "success", "accent", "foreground",
                 "background", "surface", "panel", "boost", "dark", "luminosity_spread", "text_alpha"}


class ThemeFileError(ValueError):
    """A theme file that can't be used; the message names the file."""


def theme_from_toml(text: str, source: str = "<theme>") -> Theme:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ThemeFileError(f"{source}: not valid TOML: {e}") from None
    unknown = set(data) - _THEME_FIELDS - {"variables", "tab_colors"}
    if unknown:
        raise ThemeFileError(f"{source}: unknown keys {sorted(unknown)}")
    if "name" not in data or "primary" not in data:
        raise ThemeFileError(f"{source}: a theme needs at least 'name' and 'primary'")
    variables = dict(data.get("variables", {}))
    tab_colors = data.get("tab_colors", [])
    if not isinstance(tab_colors, list) or not all(isinstance(c, str) for c in tab_colors):
        raise ThemeFileError(f"{source}: tab_colors must be a list of colour strings")
    # Theme has no field for them; its variables dict carries them along with the theme.
    for i, color in enumerate(tab_colors):
        variables[_TAB_COLOR_VARIABLE.format(i)] = color
    return Theme(**{k: v for k, v in data.items() if k in _THEME_FIELDS}, variables=variables)


def load_themes() -> list[Theme]:
    """Every theme shipped in this package, sorted by file name."""
    files = sorted((f for f in resources.files(__name__).iterdir() if f.name.endswith(".toml")),
                   key=lambda f: f.name)
    return [theme_from_toml(f.read_text(encoding="utf-8"), f.name) for f in files]


def tab_colors(theme: Theme) -> list[str]:
    colors = []
    while (color := theme.variables.get(_TAB_COLOR_VARIABLE.format(len(colors)))) is not None:
        colors.append(color)
    return colors or list(DEFAULT_TAB_COLORS)
