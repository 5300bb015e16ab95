# mypy: ignore-errors
# Test fixture: analysed statically by dsec_rules.infer, never imported or run.
"""CrewAI idioms (test fixture)."""

import os

import aiohttp
from crewai.tools import BaseTool, tool
from crewai_tools import SerperDevTool


class WeatherTool(BaseTool):
    name: str = "weather_lookup"
    description: str = "Current weather"

    async def _run(self, city: str) -> str:
        key = os.environ.get("OPENWEATHERMAP_API_KEY")
        async with aiohttp.ClientSession() as session:
            url = "https://api.openweathermap.org/data/2.5/weather"
            async with session.get(url, params={"q": city, "appid": key}) as resp:
                return await resp.text()


@tool("Fetch page")
def fetch_page(url: str) -> str:
    """Fetch any page (dynamic URL)."""
    import urllib.request

    return urllib.request.urlopen(url).read().decode()


serper = SerperDevTool()
