"""Live views: page map (anywidget canvas), timelines (plotly), findings table, dashboard, static HTML."""
from .dashboard import Dashboard, Throttle
from .findings_table import FindingsTable
from .page_map import PageMap, encode
from .timelines import Timelines

__all__ = ["Dashboard", "Throttle", "FindingsTable", "PageMap", "Timelines", "encode"]
