//! The NDP responder's slot array (L2_RESP6_SLOTS) in front of L2_RESP_V6.
//!
//! `from_native` looks an announced IPv6 address up in its direct-mapped
//! slot first (an inlined array read) and falls back to the L2_RESP_V6 hash
//! when the slot does not hold the address intact. These runs go through
//! `BPF_PROG_TEST_RUN` on the loopback of a namespace the test makes, with
//! the real programs and maps, and check the advertisement each run leaves:
//! two addresses sharing a slot are both answered with their own MAC (one
//! through the slot, one through the hash); a torn slot is never believed;
//! removing the holder hands the slot to the other address; a removed
//! address is not answered.

use std::net::Ipv6Addr;

use anyhow::{Context, ensure};
use lockstep::datapath::{Datapath, DatapathOptions};
use lockstep_common::{
    Counter, L2RespSlotV6, L2RespValue, V6Addr, max_entries, program_names, slots,
};
use lockstep_tests::{Netns, PinRoot, counter_sum, privileged};

/// Loopback in the test's namespace: the interface the runs come from, and
/// the one the entries announce on.
const IFINDEX: u32 = 1;
const REDIRECT: i32 = 7;
const NEXT: i32 = -1;
const ASKER_MAC: [u8; 6] = [0x02, 0, 0, 0, 0, 9];
const ASKER: [u8; 16] = [0xfd, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2];

/// A Neighbor Solicitation for `target` from `ASKER`, with a source
/// link-layer option.
fn solicitation(target: V6Addr) -> Vec<u8> {
    let mut p = vec![0u8; 86];
    p[0..6].copy_from_slice(&[0x33, 0x33, 0xff, target[13], target[14], target[15]]);
    p[6..12].copy_from_slice(&ASKER_MAC);
    p[12..14].copy_from_slice(&0x86DDu16.to_be_bytes());
    p[14..22].copy_from_slice(&[0x60, 0, 0, 0, 0, 32, 58, 255]);
    p[22..38].copy_from_slice(&ASKER);
    p[38..54].copy_from_slice(&[
        0xff, 2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0xff, target[13], target[14], target[15],
    ]);
    p[54] = 135;
    p[62..78].copy_from_slice(&target);
    p[78..80].copy_from_slice(&[1, 1]);
    p[80..86].copy_from_slice(&ASKER_MAC);
    p
}

/// The one's-complement sum over an IPv6 packet's ICMPv6 message and its
/// pseudo-header: 0xffff when the checksum in it is right.
fn icmpv6_sum(frame: &[u8]) -> u16 {
    let ip = &frame[14..54];
    let body = &frame[54..];
    let mut s: u32 = 0;
    let mut add = |b: &[u8]| {
        for c in b.chunks(2) {
            s += u32::from(u16::from_be_bytes([c[0], *c.get(1).unwrap_or(&0)]));
        }
    };
    add(&ip[8..40]);
    add(&(body.len() as u32).to_be_bytes());
    add(&[0, 0, 0, 58]);
    add(body);
    while s > 0xffff {
        s = (s & 0xffff) + (s >> 16);
    }
    s as u16
}

/// Runs `from_native` on a solicitation for `target`; on an answer, checks
/// it is a well-formed solicited advertisement for `target` to the asker
/// and returns the MAC it carries.
fn ask(dp: &mut Datapath, target: V6Addr) -> anyhow::Result<Option<[u8; 6]>> {
    let (ret, out) =
        dp.test_run_packet(program_names::FROM_NATIVE, &solicitation(target), IFINDEX)?;
    if ret == NEXT {
        return Ok(None);
    }
    ensure!(ret == REDIRECT, "from_native returned {ret}");
    ensure!(out.len() == 86, "advertisement of {} bytes", out.len());
    let mac: [u8; 6] = out[6..12].try_into()?;
    ensure!(out[0..6] == ASKER_MAC, "not sent back to the asker");
    ensure!(out[22..38] == target && out[38..54] == ASKER, "addresses");
    ensure!(
        out[54] == 136 && out[58] == 0x60,
        "solicited NA with override"
    );
    ensure!(out[62..78] == target, "target");
    ensure!(
        out[78..80] == [2, 1] && out[80..86] == mac,
        "target link-layer option"
    );
    ensure!(icmpv6_sum(&out) == 0xffff, "ICMPv6 checksum");
    Ok(Some(mac))
}

fn entry(last: u8) -> L2RespValue {
    L2RespValue {
        ifindex: IFINDEX,
        mac: [2, 0, 0, 0, 0, last],
        ..Default::default()
    }
}

#[test]
fn addresses_sharing_a_slot_torn_slots_and_removal_all_answer_right() -> anyhow::Result<()> {
    privileged!();
    // Two addresses of one /64 that share a slot (found by search: about
    // one in L2_RESP6_SLOTS does).
    let base: V6Addr = Ipv6Addr::new(0xfd00, 0x6e, 0, 0, 0, 0, 0, 0).octets();
    let with_low = |i: u32| -> V6Addr {
        let mut a = base;
        a[12..16].copy_from_slice(&i.to_be_bytes());
        a
    };
    let a = with_low(std::process::id());
    let slot = slots::l2_resp_v6(a);
    let b = (1..64 * max_entries::L2_RESP6_SLOTS)
        .map(|i| with_low(std::process::id().wrapping_add(i)))
        .find(|b| slots::l2_resp_v6(*b) == slot)
        .context("no address sharing the slot")?;
    let (low, high) = if a < b { (a, b) } else { (b, a) };

    let ns = Netns::new("ndpslot")?;
    let pins = PinRoot::new();
    ns.run(|| -> anyhow::Result<()> {
        let mut dp = Datapath::open(DatapathOptions::new(pins.path()))?;
        let mut maps = dp.maps()?;
        maps.l2_insert_v6(high, &entry(0xbb))?;
        maps.l2_insert_v6(low, &entry(0xaa))?;
        // The smaller address holds the slot; the other is in the hash only.
        let held = maps.l2_resp6_slots().get(&slot, 0)?;
        ensure!(
            held == L2RespSlotV6::new(low, &entry(0xaa)),
            "slot holds {held:?}"
        );

        ensure!(
            ask(&mut dp, low)? == Some(entry(0xaa).mac),
            "the slot's address"
        );
        ensure!(
            ask(&mut dp, high)? == Some(entry(0xbb).mac),
            "the hash's address"
        );
        ensure!(counter_sum(&dp.maps()?, Counter::NdpReplied)? == 2);

        // A torn slot: the holder's key intact, a MAC whose complement is
        // still the genuine one's. Never believed: the hash answers.
        let torn = L2RespSlotV6 {
            mac: [2, 0, 0, 0, 0, 0xee],
            ..held
        };
        maps.l2_resp6_slots_mut().set(slot, torn, 0)?;
        ensure!(
            ask(&mut dp, low)? == Some(entry(0xaa).mac),
            "a torn slot was believed"
        );
        // An intact slot is used on its own, without the hash (here for an
        // address the hash does not hold): proof the program reads slots.
        let c = with_low(0xffff_fff0);
        let c_slot = slots::l2_resp_v6(c);
        if c_slot != slot {
            maps.l2_resp6_slots_mut()
                .set(c_slot, L2RespSlotV6::new(c, &entry(0xcc)), 0)?;
            ensure!(ask(&mut dp, c)? == Some(entry(0xcc).mac), "slot not read");
            maps.l2_resp6_slots_mut()
                .set(c_slot, L2RespSlotV6::default(), 0)?;
            ensure!(ask(&mut dp, c)?.is_none(), "an emptied slot still answers");
        }

        // Removing the holder hands the slot to the other address.
        ensure!(maps.l2_remove_v6(low)?, "the entry existed");
        let held = maps.l2_resp6_slots().get(&slot, 0)?;
        ensure!(
            held == L2RespSlotV6::new(high, &entry(0xbb)),
            "slot holds {held:?}"
        );
        let ignored = counter_sum(&dp.maps()?, Counter::NdpIgnored)?;
        ensure!(
            ask(&mut dp, low)?.is_none(),
            "a removed address is answered"
        );
        ensure!(counter_sum(&dp.maps()?, Counter::NdpIgnored)? == ignored + 1);
        ensure!(
            ask(&mut dp, high)? == Some(entry(0xbb).mac),
            "the new holder"
        );
        ensure!(maps.l2_remove_v6(high)?, "the entry existed");
        ensure!(maps.l2_resp6_slots().get(&slot, 0)? == L2RespSlotV6::default());
        ensure!(
            ask(&mut dp, high)?.is_none(),
            "a removed address is answered"
        );
        Ok(())
    })
}

/// A pin set from before L2_RESP6_SLOTS (the pin missing, L2_RESP_V6
/// holding an entry): opening creates and pins the array, and the address
/// is answered through the hash until the slot is filled.
#[test]
fn a_pin_set_without_the_slot_array_gets_one_and_still_answers() -> anyhow::Result<()> {
    privileged!();
    let mut a: V6Addr = Ipv6Addr::new(0xfd00, 0x6f, 0, 0, 0, 0, 0, 0).octets();
    a[12..16].copy_from_slice(&std::process::id().to_be_bytes());
    let ns = Netns::new("ndpslotup")?;
    let pins = PinRoot::new();
    ns.run(|| -> anyhow::Result<()> {
        {
            let dp = Datapath::open(DatapathOptions::new(pins.path()))?;
            dp.maps()?.l2_insert_v6(a, &entry(0xa1))?;
        }
        let pin = pins
            .path()
            .join("maps")
            .join(lockstep_common::map_names::L2_RESP6_SLOTS);
        std::fs::remove_file(&pin).context("removing the slot array's pin")?;
        let mut dp = Datapath::open(DatapathOptions::new(pins.path()))?;
        ensure!(pin.exists(), "the slot array was not pinned again");
        let maps = dp.maps()?;
        ensure!(
            maps.l2_resp6_slots().get(&slots::l2_resp_v6(a), 0)? == L2RespSlotV6::default(),
            "a new slot array holds something"
        );
        ensure!(
            ask(&mut dp, a)? == Some(entry(0xa1).mac),
            "not answered from the hash"
        );
        Ok(())
    })
}
