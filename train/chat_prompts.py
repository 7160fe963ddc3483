"""Instruction prompts for self-distilling a chat target: task templates x topics.

A chat model's drafters should learn the answers it gives to users, so the training
text is the target's own responses to prompts like these (`train/responses.py`).
Prompts are built from templates and topics written here (no download), and split
train / held-out by a stable hash of the topic: a held-out prompt's topic never
appears in a training prompt. Held-out prompts still share the training prompts'
templates, and the answers' shapes with them, so they flatter a drafter (SmolLM2's
default EAGLE head, scored on its answers: top-1 0.32 there, 0.20 on requests written apart). The
`freeform` split is such requests: written apart from the templates, the topics and
the bench's prompts, never trained on; its score is the one that predicts chat.
"""

from __future__ import annotations

import hashlib
import random

SPLITS = ("train", "heldout")  # template splits; FREEFORM is the third held-out set
HELDOUT_PER_MILLE = 150  # ~15% of topics

# {t}: a topic. Kept varied in shape (explain, list, compare, write, code) so the
# responses cover the kinds of answers a chat model gives.
TEMPLATES = (
    "Explain {t} in simple terms.",
    "What is {t}? Answer in a short paragraph.",
    "Give me three interesting facts about {t}.",
    "Write a short poem about {t}.",
    "Summarize what a beginner should know about {t}.",
    "List five key ideas related to {t}, one per line.",
    "Why is {t} important? Give two reasons.",
    "Write a short story for children that involves {t}.",
    "How would you explain {t} to a ten-year-old?",
    "What are common misconceptions about {t}?",
    "Write a tweet announcing a new book about {t}.",
    "Give step-by-step advice for someone who wants to learn about {t}.",
    "Describe {t} in exactly three sentences.",
    "What questions should I ask an expert on {t}?",
    "Compare {t} with something from everyday life.",
    "Write an email to a friend recommending that they read about {t}.",
)

# Code requests answered in the chat format (the bench's code prompts are raw text instead).
CODE_TEMPLATES = (
    "Write a Python function that {t}.",
    "Show me how to {t} in Python, with a short explanation.",
    "Write a Python class with a method that can {t}.",
)

TOPICS = (
    "photosynthesis", "the water cycle", "black holes", "the French Revolution", "climate change",
    "machine learning", "the human heart", "volcanoes", "the stock market", "renewable energy",
    "the Roman Empire", "DNA", "the internet", "coffee", "honeybees", "gravity", "the moon landing",
    "democracy", "chess", "the immune system", "recycling", "electric cars", "the Great Wall of China",
    "jazz music", "sleep", "vaccines", "the Renaissance", "ocean tides", "inflation", "blockchain",
    "dinosaurs", "the solar system", "meditation", "earthquakes", "the printing press", "rainforests",
    "time management", "nutrition", "public speaking", "the Olympic Games", "antibiotics", "glaciers",
    "quantum computing", "the Industrial Revolution", "bread baking", "birds migration", "gardening",
    "cloud computing", "the periodic table", "Shakespeare", "the pyramids of Egypt", "friendship",
    "volunteering", "budgeting", "the Amazon river", "solar panels", "penguins", "the Cold War",
    "robots", "mountains", "coral reefs", "writing a resume", "learning a new language", "tea",
    "the stock exchange", "artificial intelligence ethics", "bicycles", "the human brain", "rain",
    "ancient Greece", "recycling plastic", "hiking", "music theory", "the speed of light", "bacteria",
    "cats", "dogs", "trees", "deserts", "the Silk Road", "the Moon", "Mars", "electricity", "magnets",
    "weather forecasting", "the Internet of Things", "origami", "yoga", "video games", "libraries",
    "smartphones", "airplanes", "trains", "elephants", "whales", "butterflies", "cheese", "chocolate",
)

CODE_TOPICS = (
    "reverses a string", "checks whether a number is prime", "computes the factorial of n",
    "merges two sorted lists", "counts the words in a text", "finds the largest element of a list",
    "removes duplicates from a list while keeping order", "reads a CSV file and sums a column",
    "computes Fibonacci numbers", "checks whether a string is a palindrome", "flattens a nested list",
    "converts Celsius to Fahrenheit", "sorts a list of dictionaries by a key", "validates an email address",
    "computes the mean and median of a list", "finds the most common element", "implements binary search",
    "parses command line arguments", "formats a date as YYYY-MM-DD", "transposes a matrix",
    "counts vowels in a string", "groups words by their first letter", "implements a stack",
    "implements a queue with two stacks", "computes the greatest common divisor", "generates all subsets",
    "rotates a list by k positions", "checks balanced parentheses", "converts a number to binary",
    "finds anagrams in a list of words", "implements bubble sort", "computes a running average",
    "chunks a list into pieces of size n", "writes a dictionary to a JSON file", "capitalizes every word",
    "finds the second largest number", "computes the power set size", "validates a sudoku row",
    "implements a simple LRU cache", "measures how long a function takes",
)


# Requests as users type them: none from a template above, none on a training topic, none in
# bench/prompts. They score the trainers only (`freeform_prompts`).
FREEFORM = (
    "How can I stop procrastinating when I work from home?",
    "What's a good way to explain recursion to a new programmer?",
    "Can you recommend a simple dinner I can cook in twenty minutes?",
    "Why do my ears pop during a flight?",
    "What should I check before buying a used car?",
    "Why does my bread come out dense and flat?",
    "What is the best way to prepare for a job interview?",
    "Tell me about the history of the bicycle.",
    "My laptop is running slowly. What can I check?",
    "Write a thank-you note to a neighbour who watered my plants.",
    "What is the difference between weather and climate?",
    "Give me a packing list for a beach holiday.",
    "How do I calculate the area of a circle?",
    "Explain how a bill becomes a law in simple steps.",
    "What are some good habits for keeping my code readable?",
    "I feel nervous before giving a presentation. Any advice?",
    "Is it better to rent or buy a house?",
    "How do noise-cancelling headphones work?",
    "Suggest a name for a small bakery that sells sourdough.",
    "What does a product manager do all day?",
    "My tomato plants have yellow leaves. What is wrong?",
    "Plan a one-day visit to a city I have never seen before.",
    "How often should I water a cactus?",
    "Rewrite this sentence to sound more polite: send me the report now.",
)


def freeform_prompts(n: int) -> list[str]:
    """The first `n` free-form requests (all of them when n exceeds their number)."""
    return list(FREEFORM[:n])


def split_of(topic: str) -> str:
    """'train' or 'heldout' for a topic (sha256: stable across processes and machines)."""
    bucket = int.from_bytes(hashlib.sha256(topic.encode("utf-8")).digest()[:4], "big") % 1000
    return "heldout" if bucket < HELDOUT_PER_MILLE else "train"


def chat_prompts(split: str, n: int, seed: int = 0) -> list[str]:
    """`n` distinct user messages of one split, deterministic for `seed` (fewer when fewer exist)."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
    pool = [tpl.format(t=t) for t in TOPICS if split_of(t) == split for tpl in TEMPLATES]
    pool += [tpl.format(t=t) for t in CODE_TOPICS if split_of(t) == split for tpl in CODE_TEMPLATES]
    rng = random.Random(seed)
    rng.shuffle(pool)
    return pool[:n]
