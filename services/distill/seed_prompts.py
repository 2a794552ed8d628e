"""Seed prompts for distillation data: our own, written here (never the dev set).

Topics x instruction styles give a few hundred varied open-chat requests;
the target answers them and the draft learns from those answers.
"""

from __future__ import annotations

import random

TOPICS = [
    "baking sourdough bread", "the water cycle", "learning a second language", "saving money on groceries",
    "the history of the printing press", "training for a first 10k run", "how vaccines work", "black holes",
    "starting a vegetable garden", "writing a cover letter", "the French Revolution", "caring for a puppy",
    "recursion in programming", "climate change", "time management for students", "photosynthesis",
    "the stock market", "planning a road trip", "meditation", "the Roman Empire", "electric cars",
    "making friends in a new city", "volcanoes", "public speaking", "the human immune system", "chess openings",
    "renewable energy", "writing a short poem", "the Renaissance", "healthy sleep habits", "machine learning",
    "negotiating a salary", "the solar system", "composting", "the invention of the telephone",
    "job interviews", "ocean tides", "budgeting for a wedding", "how airplanes fly", "the Great Wall of China",
    "learning to play guitar", "recycling plastics", "the internet", "remote work", "honeybees",
    "making pasta from scratch", "earthquakes", "a rainy afternoon", "the moon landing", "minimalism",
    "databases", "mountain hiking safety", "ancient Egypt", "kindness", "the periodic table", "coffee",
    "version control with git", "a lost cat", "friendship", "the Olympic Games",
]

STYLES = [
    "Explain {topic} to a curious ten-year-old.",
    "Give me three practical tips about {topic}.",
    "What are the pros and cons of {topic}?",
    "Write a short story that involves {topic}.",
    "Summarize the most important facts about {topic} in a few sentences.",
    "I am new to {topic}. Where should I start?",
    "Write a friendly email to a colleague about {topic}.",
    "What are common mistakes people make with {topic}?",
    "Describe {topic} in one paragraph.",
    "Write a haiku about {topic}, then explain it.",
    "Answer briefly: why does {topic} matter?",
    "Compare {topic} with something from everyday life.",
]


def seed_prompts(seed: int = 0) -> list[str]:
    """Every topic x style, shuffled with a fixed seed (so shards are reproducible)."""
    prompts = [style.format(topic=topic) for topic in TOPICS for style in STYLES]
    random.Random(seed).shuffle(prompts)
    return prompts
