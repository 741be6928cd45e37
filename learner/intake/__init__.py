"""Data intake: prompts admitted for the learner's version (`admission`), the trajectory streams
read (`reader`), sorted (`triage`), assembled into groups (`assemble`), held until a step takes
them (`ready`, `take`, `recent`), settled when dropped (`drops`), and what one rank collected
for a step (`collect`, `collected`); `lineage` says which step each version holds."""
