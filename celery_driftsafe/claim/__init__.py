"""The claim: rounds that take due slots under the claimers' contract, their SQL, the outbox (what a
claimed run is published with), and claiming ahead in a thread or a helper process."""
