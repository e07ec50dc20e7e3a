"""Chat prompts for speculative decoding on a real chat model, written for pdserve (no dataset
is reachable offline).

- `chat_prompts("train")` / `chat_prompts("held_out")`: instructions about everyday topics;
  the two sets share no topic and no phrasing, so a draft trained on the first is measured
  on prompts it has never seen.
- `repetition_prompts()`: answers that repeat their context (edit this code, summarize or
  rewrite this passage), where NGRAM drafting has something to match.

    python benchmarks/real_text_prompts.py --out-dir prompts/   # writes the three JSONL files
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
from pathlib import Path

TRAIN_TOPICS = """\
the ocean, volcanoes, photosynthesis, the Roman Empire, bicycles, coffee, the moon,
honeybees, rainbows, the printing press, electricity, chess, the human heart, deserts,
clouds, penguins, the internet, bread baking, earthquakes, the piano, glaciers, vaccines,
the Great Wall of China, tea, magnets, rain forests, the solar system, dinosaurs, recycling,
trains, the immune system, music theory, gardening, the French Revolution, airplanes, sleep,
whales, mountains, batteries, the alphabet, friendship, exercise, libraries, the weather,
wolves, mathematics, rivers, castles, robots, the stock market, soap, coral reefs, the
Olympic Games, windmills, maps, bees and flowers, fire, lighthouses, owls, chocolate,
spiders, the Sahara, submarines, the telescope, paper, cheese, the violin, the Amazon river,
solar panels, thunderstorms, ancient Egypt, the camera, salt, octopuses, the periodic table,
bridges, rice, the brain, ants, snow, kites, democracy, the wheel, compost, clocks, tigers,
the Arctic, elephants, dreams, gravity, the guitar, pizza, the bicycle chain, frogs,
umbrellas, jazz, comets, the post office, yoga, paper boats, atoms, DNA, evolution, the
water cycle, plate tectonics, fossils, bacteria, viruses, antibiotics, the skeleton,
muscles, the lungs, digestion, blood, the eye, hearing, taste, memory, emotions, habits,
nutrition, vitamins, sugar, caffeine, stress, laughter, meditation, running, swimming,
cycling races, football, basketball, tennis, baseball, cricket, golf, skiing, surfing, rock
climbing, boxing, martial arts, the Tour de France, the World Cup, referees, stadiums,
sports fans, video games, board games, card games, puzzles, crossword puzzles, magic tricks,
circuses, theme parks, roller coasters, zoos, museums, art galleries, painting, sculpture,
photography, film making, animation, cartoons, comic books, novels, poetry, fairy tales,
mythology, Greek gods, Norse myths, dragons, unicorns, pirates, knights, samurai, Vikings,
the Aztecs, the Maya, the Inca, ancient Greece, ancient China, the Ottoman Empire, the
Industrial Revolution, the Cold War, the moon landing, the space race, the first computers,
the telephone, the radio, television, the light bulb, the steam engine, cars, electric cars,
motorcycles, ships, sailing, canals, highways, traffic lights, airports, rockets,
satellites, the International Space Station, Mars, Jupiter, Saturn's rings, Venus, Pluto,
asteroids, meteors, stars, galaxies, the Milky Way, the Big Bang, light, sound, heat,
magnetism, friction, energy, nuclear power, oil, coal, natural gas, hydropower, geothermal
energy, climate change, air pollution, plastic waste, deforestation, endangered species,
national parks, forests, grasslands, wetlands, caves, islands, lakes, waterfalls, canyons,
beaches, the Himalayas, the Alps, the Rocky Mountains, the Nile, the Mississippi River,
Antarctica, Australia, Japan, India, Brazil, Canada, Mexico, Egypt, Italy, France, Kenya,
Iceland, Norway, Peru, Russia, New York City, London, Paris, Tokyo, Rome, Venice, Istanbul,
Cairo, Sydney, villages, cities, skyscrapers, houses, apartments, furniture, kitchens,
cooking, baking cakes, soup, pasta, sushi, tacos, curry, noodles, dumplings, salads,
sandwiches, breakfast, picnics, barbecues, spices, vegetables, fruit, apples, bananas,
oranges, strawberries, potatoes, tomatoes, corn, wheat, farming, tractors, cows, horses,
sheep, pigs, chickens, goats, dogs, cats, rabbits, hamsters, parrots, goldfish, turtles,
snakes, lizards, crocodiles, sharks, dolphins, seals, polar bears, pandas, koalas,
kangaroos, giraffes, zebras, lions, cheetahs, gorillas, chimpanzees, bats, butterflies,
ladybugs, mosquitoes, earthworms, snails, crabs, lobsters, starfish, eagles, crows, pigeons,
flamingos, swans, migration, hibernation, camouflage, food chains, trees, oak trees,
redwoods, cactus plants, roses, tulips, seeds, leaves, soil, moss, algae, money, banks,
taxes, budgeting, saving money, credit cards, shopping, advertising, marketing, small
businesses, startups, job interviews, teamwork, leadership, negotiation, public speaking,
writing a resume, time management, procrastination, motivation, goal setting, learning a
language, reading, handwriting, spelling, grammar, punctuation, dictionaries, translation,
sign language, school, homework, exams, teachers, universities, scholarships, science fairs,
experiments, the scientific method, statistics, probability, geometry, algebra, fractions,
prime numbers, infinity, zero, calculators, computers, smartphones, laptops, programming,
Python, websites, email, social media, passwords, computer viruses, artificial intelligence,
machine learning, data, cloud computing, 3D printing, drones, virtual reality, self-driving
cars, electric scooters, the keyboard, the mouse, printers, headphones, music streaming,
podcasts, newspapers, journalism, books for children, comics, libraries in schools, doctors,
nurses, dentists, hospitals, ambulances, police officers, pilots, astronauts, chefs,
farmers, carpenters, plumbers, electricians, architects, engineers, lawyers, judges,
scientists, inventors, artists, musicians, actors, writers, photographers, gardeners, mail
carriers, volunteers, charity, kindness, honesty, courage, patience, gratitude, happiness,
loneliness, families, grandparents, siblings, babies, childhood, growing old, birthdays,
weddings, holidays, New Year, festivals, fireworks, parades, costumes, masks, dancing,
ballet, hip hop, rock music, classical music, opera, orchestras, drums, the flute, the
trumpet, the harp, singing, choirs, concerts, radio shows, theater, Shakespeare, fashion,
shoes, hats, jewelry, cotton, wool, silk, sewing, knitting, pottery, woodworking, glass,
steel, gold, diamonds, concrete, rubber, plastic, water, ice, steam, wind, storms,
hurricanes, tornadoes, floods, droughts, wildfires, seasons, spring, summer, autumn, winter,
sunsets, the night sky, time zones, calendars, the speed of light, electricity at home,
plumbing, heating, air conditioning, refrigerators, washing machines, vacuum cleaners,
cleaning, laundry, camping, hiking, fishing, sailing trips, road trips, travel, passports,
hotels, trains in Europe, maps and compasses, GPS, the Internet of Things, robots in
factories, elevators, escalators, tunnels, dams, lighthouses at sea, ports, containers and
shipping, trade, markets, coins, barter, chess openings, checkers, dominoes,
playgrounds, swings, sandcastles, snowmen, treehouses, pets at home, veterinarians, bird
watching, stargazing, astronomy clubs, microscopes, cells, genes, twins, blood types,
allergies, the common cold, fever, handwashing, first aid, bandages, healthy eating, water
drinking, posture, stretching, walking, breathing, the heartbeat, the skin, hair, teeth,
bones, the stomach, the liver, the kidneys, the nose, fingerprints"""
TRAIN_TOPICS = [topic.strip() for topic in TRAIN_TOPICS.replace("\n", " ").split(",")]

HELD_OUT_TOPICS = """black holes, sourdough, the Silk Road, hummingbirds, tides, the saxophone,
wind turbines, mushrooms, the Renaissance, cryptography, hot air balloons, jellyfish, origami,
the Andes, bamboo, firefighters, sunflowers, the metro, marathons, lightning""".replace(
    "\n", " "
).split(", ")

TRAIN_TEMPLATES = [
    "Explain {t} to a ten-year-old.",
    "Write a short poem about {t}.",
    "Give me three interesting facts about {t}.",
    "What are the pros and cons of {t}?",
    "Write a short story that involves {t}.",
    "Describe {t} in one paragraph.",
    "Why is {t} important?",
    "How would you teach a friend about {t}?",
    "Write a haiku about {t}.",
    "What is the history of {t}?",
    "List five words that come to mind when you think of {t}.",
    "Write a product description for something inspired by {t}.",
    "Summarize what most people know about {t}.",
    "What questions would a scientist ask about {t}?",
    "Compare {t} with something from everyday life.",
    "Write a limerick about {t}.",
    "Tell me a fun fact about {t}, then explain why it is true.",
    "Write a diary entry from the point of view of someone who loves {t}.",
    "What is a common misconception about {t}?",
    "Give a step-by-step explanation of how {t} works.",
    "What is {t}?",
    "Teach me the basics of {t}.",
    "I would like to learn about {t}. Where do I start?",
    "Give me an overview of {t}.",
    "How has {t} changed over time?",
    "What would the world be like without {t}?",
    "Write a short dialogue between two friends talking about {t}.",
    "Explain {t} as if I knew nothing about it.",
    "What are the most important things to understand about {t}?",
    "Write a blog post introduction about {t}.",
    "Give me a quiz with three questions about {t}.",
    "How is {t} connected to our daily lives?",
    "Write a letter to a friend describing {t}.",
    "What are some surprising things about {t}?",
    "Explain the science behind {t}.",
    "What would you tell a tourist about {t}?",
    "Write a speech for a class presentation on {t}.",
    "Describe {t} to someone who has never seen it.",
    "What are the main parts of {t}?",
    "What is the future of {t}?",
    "Write a song chorus about {t}.",
    "Give me a simple definition of {t} and an example.",
    "How do people around the world think about {t}?",
    "Write a short news report about {t}.",
    "Explain why people find {t} interesting.",
    "What problems are related to {t}, and how can they be solved?",
    "Create a short lesson plan about {t}.",
    "Write a riddle whose answer is {t}.",
    "What should a beginner know about {t}?",
    "Describe a day in the life of someone who works with {t}.",
]

# Training prompts come plain and with each of these asks appended.
TRAIN_STYLES = [
    "",
    " Answer in two sentences.",
    " Use simple words.",
    " Answer with a numbered list.",
    " Be enthusiastic.",
]

HELD_OUT_TEMPLATES = [
    "Can you tell me about {t}?",
    "I am curious about {t}. What should I know?",
    "Write a few sentences about {t} for a school report.",
    "What makes {t} special?",
]

CODE_SNIPPETS = [
    """def average(values):
    total = 0
    for value in values:
        total += value
    return total / len(values)""",
    """def count_words(text):
    counts = {}
    for word in text.split():
        word = word.lower()
        counts[word] = counts.get(word, 0) + 1
    return counts""",
    """def is_palindrome(word):
    cleaned = word.lower().replace(" ", "")
    return cleaned == cleaned[::-1]""",
    """def fizzbuzz(n):
    for i in range(1, n + 1):
        if i % 15 == 0:
            print("FizzBuzz")
        elif i % 3 == 0:
            print("Fizz")
        elif i % 5 == 0:
            print("Buzz")
        else:
            print(i)""",
    """def largest(numbers):
    best = numbers[0]
    for number in numbers:
        if number > best:
            best = number
    return best""",
    """def celsius_to_fahrenheit(celsius):
    fahrenheit = celsius * 9 / 5 + 32
    return fahrenheit""",
    """class Counter:
    def __init__(self):
        self.count = 0

    def increment(self):
        self.count += 1
        return self.count""",
    """def read_lines(path):
    with open(path) as handle:
        lines = handle.readlines()
    return [line.strip() for line in lines]""",
]

CODE_EDITS = [
    "Add a docstring to this Python function and return the whole function:\n\n{c}",
    "Add comments to this Python code and show the full code:\n\n{c}",
    "Rewrite this Python code with type hints. Show the complete code:\n\n{c}",
]

PASSAGES = [
    "The town library opened in 1952 in a small brick building near the river. At first it "
    "held only a few hundred books, most of them donated by families in the town. Over the "
    "years the collection grew, and in 1980 the library moved into a larger building with a "
    "reading room, a children's corner and a small theater for community events.",
    "Honey is made by bees from the nectar of flowers. A bee collects nectar, stores it in a "
    "special stomach, and brings it back to the hive. There, other bees pass the nectar from "
    "one to another, and water evaporates from it until it becomes thick and sweet. The bees "
    "then seal the honey in wax cells to keep it for the winter.",
    "The bicycle was invented in the nineteenth century. Early models had no pedals: riders "
    "pushed themselves along with their feet. Later designs added pedals to a huge front "
    "wheel, which made them fast but dangerous. The safety bicycle, with two wheels of the "
    "same size and a chain, made cycling popular around the world.",
    "A rainbow appears when sunlight passes through drops of rain. Each drop bends the light "
    "and splits it into its colors, from red to violet. To see a rainbow, you must stand "
    "with the sun behind you and the rain in front of you. Sometimes a second, fainter "
    "rainbow appears above the first, with its colors in the opposite order.",
    "Maria started her bakery with one oven and a single recipe for bread. Every morning she "
    "woke up at four to prepare the dough. Customers liked the bread so much that she soon "
    "added cakes, cookies and pies. Ten years later, the bakery employs twelve people and "
    "still uses the same bread recipe that Maria began with.",
    "Glaciers are large bodies of ice that move slowly over land. They form where more snow "
    "falls in winter than melts in summer. As the snow piles up, it is pressed into ice. "
    "Glaciers carve valleys, carry rocks over long distances and store a large share of the "
    "fresh water on Earth.",
]

PASSAGE_TASKS = [
    "Summarize the following passage in two sentences:\n\n{p}",
    "Rewrite the following passage in simpler words:\n\n{p}",
    "Repeat the following passage, then give it a title:\n\n{p}",
]


def _messages(text: str) -> dict:
    return {"messages": [{"role": "user", "content": text}]}


def chat_prompts(split: str, seed: int = 0) -> list[dict]:
    """Every topic x template (x style, for training) of the split, in a seeded random
    order."""
    topics, templates, styles = {
        "train": (TRAIN_TOPICS, TRAIN_TEMPLATES, TRAIN_STYLES),
        "held_out": (HELD_OUT_TOPICS, HELD_OUT_TEMPLATES, [""]),
    }[split]
    prompts = [
        _messages(template.format(t=topic) + style)
        for topic, template, style in itertools.product(topics, templates, styles)
    ]
    random.Random(seed).shuffle(prompts)
    return prompts


def repetition_prompts(seed: int = 0) -> list[dict]:
    prompts = [_messages(e.format(c=c)) for c, e in itertools.product(CODE_SNIPPETS, CODE_EDITS)]
    prompts += [_messages(t.format(p=p)) for p, t in itertools.product(PASSAGES, PASSAGE_TASKS)]
    random.Random(seed).shuffle(prompts)
    return prompts


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out-dir", required=True)
    out = Path(parser.parse_args().out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for name, records in (
        ("chat_train", chat_prompts("train")),
        ("chat_held_out", chat_prompts("held_out")),
        ("repetition", repetition_prompts()),
    ):
        print(write_jsonl(out / f"{name}.jsonl", records), len(records))


if __name__ == "__main__":
    main()
