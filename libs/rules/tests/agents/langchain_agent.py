# mypy: ignore-errors
# Test fixture: analysed statically by dsec_rules.infer, never imported or run.
"""LangChain idioms (test fixture: analysed, never run)."""

import os

import httpx
from langchain.agents import load_tools
from langchain_community.tools.tavily_search import TavilySearchResults
from langchain_core.tools import StructuredTool, Tool, tool

BASE = "https://api.quotes.test"


@tool
def quote_of_the_day() -> str:
    """Fetch a quote."""
    return httpx.get(f"{BASE}/today").text


@tool("stock_price")
def price(symbol: str) -> str:
    """Price of a symbol."""
    token = os.environ["MARKET_TOKEN"]
    return httpx.get(f"https://market.test:8443/v1/{symbol}", headers={"t": token}).text


def translate(text: str) -> str:
    return _call_translator(text)


def _call_translator(text: str) -> str:
    return httpx.post("https://translate.test/v2", json={"q": text}).text


translate_tool = Tool(name="translate", func=translate, description="Translate text")
summarize = StructuredTool.from_function(func=translate, name="summarize")
search = TavilySearchResults(max_results=3)
extra = load_tools(["llm-math", "wikipedia"])
model_key = os.getenv("OPENAI_API_KEY")
debug = os.getenv("AGENT_DEBUG", "0")
