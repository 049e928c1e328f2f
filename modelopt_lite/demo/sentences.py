"""Built-in English sentences for the MiniLM demo: a calibration set and a held-out retrieval set.

Both are written for this project. The calibration set is generated from templates x topics (varied subjects,
registers and lengths, deterministic order); the retrieval set is hand-written query/passage pairs on topics and
wordings that do not occur in the calibration set, so the evaluation is held out.
"""

from __future__ import annotations

# (subject, a detail, a place or context) per topic
_TOPICS: tuple[tuple[str, str, str], ...] = (
    ("the night train", "left twenty minutes late", "at the border station"),
    ("our kitchen garden", "produced more courgettes than we could eat", "behind the old shed"),
    ("the quarterly budget", "was cut by a tenth", "after the board meeting"),
    ("the harbour ferry", "stopped running because of fog", "on the northern route"),
    ("the new library wing", "opened with a reading marathon", "near the river"),
    ("my grandmother's bread recipe", "needs a very slow second rise", "in a cold kitchen"),
    ("the chess club", "lost its final match by half a point", "in the regional league"),
    ("the solar panels", "covered most of the winter heating", "on the school roof"),
    ("the volunteer fire crew", "trained with a new pump", "at the quarry"),
    ("the jazz quartet", "played an unplanned encore", "in the basement bar"),
    ("the apple harvest", "came two weeks early", "in the upper valley"),
    ("the software update", "broke the printer driver", "on every office laptop"),
    ("the mountain hut", "ran out of firewood", "during the storm"),
    ("the city marathon", "changed its route", "around the cathedral"),
    ("the science fair", "awarded a prize for a water filter", "in the town hall"),
    ("the migrating geese", "rested for three days", "on the flooded meadow"),
    ("the pottery class", "fired its first batch of bowls", "in the community centre"),
    ("the bridge repairs", "closed one lane", "for the whole summer"),
    ("the football season", "ended with a penalty shoot-out", "in front of a full stadium"),
    ("the hospital night shift", "handled twice the usual patients", "during the heatwave"),
    ("the wind farm", "produced a record amount of power", "off the coast"),
    ("the theatre company", "rehearsed a play about lighthouse keepers", "in a converted warehouse"),
    ("the bakery on the corner", "started selling rye sourdough", "every Saturday"),
    ("the astronomy society", "photographed a comet", "above the reservoir"),
    ("the delivery robot", "got stuck in the snow", "outside the pharmacy"),
    ("the museum", "borrowed a medieval map", "for the spring exhibition"),
    ("the cycling lane", "was finally painted", "along the canal"),
    ("the choir", "sang in four languages", "at the harvest festival"),
    ("the research team", "published its measurements", "in an open journal"),
    ("the old lighthouse", "was turned into a small hotel", "on the cliff"),
)

_TEMPLATES: tuple[str, ...] = (
    "Yesterday {s} {d} {p}.",
    "Did you hear that {s} {d} {p}?",
    "According to the local paper, {s} {d} {p}.",
    "Nobody expected it, but {s} {d} {p}.",
    "I was told that {s} {d}; it happened {p}.",
    "{S} {d} {p}, which surprised almost everyone.",
    "If the rumours are right, {s} {d} {p} again this year.",
    "Last week {s} {d} {p}, so plans had to change.",
    "It is worth noting that {s} {d} {p}.",
    "A friend of mine says {s} {d} {p}, and she is rarely wrong.",
    "Short version: {s} {d}.",
    "Here is the news from {p}: {s} {d}.",
)


def calibration_sentences(n: int | None = None) -> list[str]:
    """Calibration sentences (templates x topics: 360 in all; the first ``n`` if given), deterministic.

    The order interleaves templates and topics so that any prefix is varied.
    """
    out = []
    nt = len(_TEMPLATES)
    for i in range(len(_TOPICS) * nt):
        s, d, p = _TOPICS[i % len(_TOPICS)]
        t = _TEMPLATES[(i + i // len(_TOPICS)) % nt]
        out.append(t.format(s=s, S=s[0].upper() + s[1:], d=d, p=p))
    if n is not None:
        if n < 1:
            raise ValueError(f"calibration_sentences: n must be >= 1, got {n}")
        out = out[:n]
    return out


# (query, the passage that answers it); topics disjoint from the calibration set
_RETRIEVAL_PAIRS: tuple[tuple[str, str], ...] = (
    (
        "How often should I water a cactus?",
        "Desert succulents need water only when the soil has dried out completely, roughly every few weeks.",
    ),
    (
        "What makes a violin sound warm?",
        "The spruce top, the varnish and the bow hair all shape the mellow tone of a string instrument.",
    ),
    (
        "Why do cats knead blankets?",
        "Pressing their paws on soft fabric is a habit kittens keep from nursing and it comforts them.",
    ),
    (
        "How do I fix a flat bicycle tyre?",
        "Remove the inner tube, find the puncture with soapy water, patch it and pump the tyre back up.",
    ),
    ("What is the capital of Australia?", "Canberra, not Sydney, is the seat of the Australian federal government."),
    (
        "How long should an egg boil for a runny yolk?",
        "Boil the egg for six minutes to get a set white and a soft, runny yolk.",
    ),
    (
        "Why is the sky blue during the day?",
        "Air molecules scatter short blue wavelengths of sunlight much more strongly than red ones.",
    ),
    (
        "When do tulip bulbs go in the ground?",
        "Plant the bulbs in autumn, before the first frost, about three times as deep as they are tall.",
    ),
    (
        "How can I sleep better at night?",
        "Keep a regular bedtime, avoid screens late in the evening and keep the bedroom cool and dark.",
    ),
    (
        "What does a mortgage broker do?",
        "This adviser compares home loans from many lenders and helps buyers apply for the best one.",
    ),
    (
        "How do bees make honey?",
        "Worker insects collect nectar, add enzymes and fan it with their wings until the water evaporates.",
    ),
    ("Which vitamin comes from sunlight?", "The skin produces vitamin D when it is exposed to ultraviolet light."),
    (
        "How do I remove a red wine stain?",
        "To get red wine out of a shirt or a carpet, blot the stain, cover it with salt and rinse it in cold water.",
    ),
    ("What is a black hole?", "It is a region of space where gravity is so strong that not even light can escape."),
    (
        "How can I learn to touch type?",
        "Typing without looking at the keyboard takes daily practice with your fingers resting on the home row keys.",
    ),
    (
        "Why do leaves change colour in autumn?",
        "As trees stop making chlorophyll, the green fades and yellow and red pigments show through.",
    ),
    (
        "How do vaccines protect people?",
        "They train the immune system to recognise a germ so that it can fight a real infection quickly.",
    ),
    (
        "What is the best way to store coffee beans?",
        "Keep the beans in an airtight, opaque container at room temperature, away from moisture.",
    ),
    ("How far away is the Moon?", "Our natural satellite orbits about 384,000 kilometres from the Earth."),
    (
        "How should I prepare for a job interview?",
        "Research the company, rehearse answers to common questions and prepare examples from past work.",
    ),
    (
        "Why do onions make you cry?",
        "Cutting them releases a sulfur compound that irritates the eyes and triggers tears.",
    ),
    (
        "How do I change a car's engine oil?",
        "Drain the old lubricant from the sump plug, replace the filter and refill with the grade in the manual.",
    ),
    (
        "What causes thunder?",
        "Lightning heats the air so quickly that it expands explosively and makes a loud shock wave.",
    ),
    (
        "How many players are on a rugby union team?",
        "Each side fields fifteen players: eight forwards and seven backs.",
    ),
    (
        "How can I make my phone battery last longer?",
        "A phone battery lasts longer with a dimmer screen, fewer background apps and charging to about eighty percent.",
    ),
    (
        "What is photosynthesis?",
        "Plants use light energy to turn carbon dioxide and water into sugar and release oxygen.",
    ),
    (
        "How do I train a puppy to sit?",
        "Hold a treat above its nose, move it back until the dog lowers itself, then reward it immediately.",
    ),
    (
        "Why does bread go stale?",
        "Starch molecules in the loaf recrystallise and lose moisture, so the crumb becomes hard.",
    ),
    (
        "What is inflation in economics?",
        "It is the general rise in prices that reduces how much a unit of money can buy.",
    ),
    (
        "How do I knit a scarf?",
        "Cast on about forty stitches with thick wool and repeat rows of garter stitch until it is long enough.",
    ),
    (
        "Where do penguins live?",
        "Most species of these flightless birds live in the cold waters of the Southern Hemisphere.",
    ),
    (
        "How can I reduce my electricity bill?",
        "Household electricity bills get smaller when you fit LED lights, insulate the loft and unplug the television.",
    ),
    (
        "What is the tallest mountain on Earth?",
        "Mount Everest in the Himalayas rises about 8,849 metres above sea level.",
    ),
    (
        "How does a refrigerator keep food cold?",
        "A compressor pumps refrigerant that absorbs heat inside the cabinet and releases it at the back.",
    ),
    (
        "Why should I stretch after running?",
        "Gentle stretching helps tired muscles relax and may reduce stiffness the next day.",
    ),
    (
        "How do I write a good cover letter?",
        "Address the hiring manager, explain why you fit the role and keep the letter to a single page.",
    ),
    (
        "What do whales eat?",
        "Baleen species filter tiny krill and plankton, while toothed species hunt fish and squid.",
    ),
    (
        "How do I brew green tea properly?",
        "Use water below boiling, around eighty degrees, and steep the leaves for two or three minutes.",
    ),
    (
        "Why do we have leap years?",
        "An extra day every four years keeps the calendar aligned with the Earth's orbit around the Sun.",
    ),
    (
        "How does a compass work?",
        "Its magnetised needle lines up with the Earth's magnetic field and points towards magnetic north.",
    ),
    (
        "What is the fastest land animal?",
        "The cheetah can sprint at more than one hundred kilometres per hour over short distances.",
    ),
    (
        "How can I improve my handwriting?",
        "Slow down, hold the pen loosely and practise letter shapes on lined paper every day.",
    ),
    ("What is a sonnet?", "A sonnet is a fourteen-line poem with a fixed rhyme scheme, often about love."),
    (
        "How do I descale a kettle?",
        "Limescale inside a kettle dissolves if you boil water and white vinegar in it and leave it for an hour.",
    ),
    (
        "Why do volcanoes erupt?",
        "Molten rock, gas and pressure build up under the crust until they force their way to the surface.",
    ),
    ("How do I back up my computer?", "Copy your files to an external drive or a cloud service on a regular schedule."),
    (
        "What language is spoken in Brazil?",
        "Portuguese is the official and most widely spoken language in that South American country.",
    ),
    (
        "How long does it take to digest food?",
        "A meal usually passes through the stomach and intestines in one to three days.",
    ),
)


def retrieval_pairs() -> list[tuple[str, str]]:
    """Held-out ``(query, passage)`` pairs (48): the i-th passage answers the i-th query."""
    return list(_RETRIEVAL_PAIRS)
