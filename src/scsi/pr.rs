//! Persistent reservations (SPC-4 5.13): registrations, one reservation,
//! the access rules they impose, and the PERSISTENT RESERVE IN/OUT
//! service actions. Pure state transitions; the logical unit locks, saves
//! and turns notifications into unit attentions.

use serde::{Deserialize, Serialize};

use super::cdb::Command;
use super::sense::Sense;

/// Registrations kept per logical unit; more are refused with
/// INSUFFICIENT REGISTRATION RESOURCES.
pub const MAX_REGISTRATIONS: usize = 64;

pub const WRITE_EXCLUSIVE: u8 = 1;
pub const EXCLUSIVE_ACCESS: u8 = 3;
pub const WRITE_EXCLUSIVE_REGISTRANTS_ONLY: u8 = 5;
pub const EXCLUSIVE_ACCESS_REGISTRANTS_ONLY: u8 = 6;
pub const WRITE_EXCLUSIVE_ALL_REGISTRANTS: u8 = 7;
pub const EXCLUSIVE_ACCESS_ALL_REGISTRANTS: u8 = 8;

const INVALID_RELEASE: Sense = Sense::new(super::sense::key::ILLEGAL_REQUEST, 0x26, 0x04);

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct Registration {
    pub nexus: String,
    pub key: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct Reservation {
    pub holder: String,
    pub kind: u8,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct State {
    pub generation: u32,
    pub registrations: Vec<Registration>,
    pub reservation: Option<Reservation>,
}

/// Why a PERSISTENT RESERVE OUT failed.
#[derive(Debug, PartialEq, Eq)]
pub enum Failure {
    Conflict,
    Sense(Sense),
}

/// Nexuses to notify, and with what unit attention.
pub type Notifications = Vec<(super::lu::Nexus, Sense)>;

fn all_registrants(kind: u8) -> bool {
    matches!(kind, WRITE_EXCLUSIVE_ALL_REGISTRANTS | EXCLUSIVE_ACCESS_ALL_REGISTRANTS)
}

fn registrants_matter(kind: u8) -> bool {
    matches!(
        kind,
        WRITE_EXCLUSIVE_REGISTRANTS_ONLY
            | EXCLUSIVE_ACCESS_REGISTRANTS_ONLY
            | WRITE_EXCLUSIVE_ALL_REGISTRANTS
            | EXCLUSIVE_ACCESS_ALL_REGISTRANTS
    )
}

fn u64_at(bytes: &[u8], at: usize) -> u64 {
    let mut b = [0u8; 8];
    b.copy_from_slice(&bytes[at..at + 8]);
    u64::from_be_bytes(b)
}

impl State {
    /// Whether a reservation restricts access.
    pub fn is_active(&self) -> bool {
        self.reservation.is_some()
    }

    fn key_of(&self, nexus: &str) -> Option<u64> {
        self.registrations.iter().find(|r| r.nexus == nexus).map(|r| r.key)
    }

    fn is_holder(&self, nexus: &str) -> bool {
        match &self.reservation {
            None => false,
            Some(r) if all_registrants(r.kind) => self.key_of(nexus).is_some(),
            Some(r) => r.holder == nexus,
        }
    }

    /// Whether `command` from `nexus` must get RESERVATION CONFLICT.
    pub fn conflicts(&self, nexus: &str, command: &Command) -> bool {
        let Some(reservation) = &self.reservation else {
            return false;
        };
        if self.is_holder(nexus) {
            return false;
        }
        if matches!(
            command,
            Command::Inquiry { .. }
                | Command::ReportLuns { .. }
                | Command::RequestSense { .. }
                | Command::TestUnitReady
                | Command::ReadCapacity10
                | Command::ReadCapacity16 { .. }
                | Command::PersistentReserveIn { .. }
                | Command::PersistentReserveOut { .. }
                | Command::ReportSupportedOpcodes { .. }
        ) {
            return false;
        }
        let registered = self.key_of(nexus).is_some();
        let writes = !command.is_read_only() || matches!(command, Command::Reserve6 | Command::Release6);
        match reservation.kind {
            WRITE_EXCLUSIVE => writes,
            WRITE_EXCLUSIVE_REGISTRANTS_ONLY | WRITE_EXCLUSIVE_ALL_REGISTRANTS => !registered && writes,
            EXCLUSIVE_ACCESS_REGISTRANTS_ONLY | EXCLUSIVE_ACCESS_ALL_REGISTRANTS => !registered,
            _ => true,
        }
    }

    /// PERSISTENT RESERVE IN data for service `action`.
    pub fn report(&self, action: u8, _nexus: &str) -> Result<Vec<u8>, Sense> {
        let mut data = self.generation.to_be_bytes().to_vec();
        data.extend_from_slice(&[0; 4]);
        match action {
            0 => {
                for registration in &self.registrations {
                    data.extend_from_slice(&registration.key.to_be_bytes());
                }
            }
            1 => {
                if let Some(reservation) = &self.reservation {
                    let key = if all_registrants(reservation.kind) {
                        0
                    } else {
                        self.key_of(&reservation.holder).unwrap_or(0)
                    };
                    data.extend_from_slice(&key.to_be_bytes());
                    data.extend_from_slice(&[0, 0, 0, 0, 0, reservation.kind & 0x0f, 0, 0]);
                }
            }
            2 => {
                // REPORT CAPABILITIES: PTPL_C, TMV, PTPL_A and the type mask.
                return Ok(vec![
                    0,
                    8,
                    0x01,
                    0x80 | 0x01,
                    0x80 | 0x40 | 0x20 | 0x08 | 0x02,
                    0x01,
                    0,
                    0,
                ]);
            }
            3 => {
                for registration in &self.registrations {
                    let holder = self.is_holder(&registration.nexus);
                    data.extend_from_slice(&registration.key.to_be_bytes());
                    data.extend_from_slice(&[0; 4]);
                    data.push(if holder { 0x01 } else { 0 });
                    data.push(match (&self.reservation, holder) {
                        (Some(r), true) => r.kind & 0x0f,
                        _ => 0,
                    });
                    data.extend_from_slice(&[0; 4]);
                    data.extend_from_slice(&1u16.to_be_bytes());
                    let transport_id = iscsi_transport_id(&registration.nexus);
                    data.extend_from_slice(&(transport_id.len() as u32).to_be_bytes());
                    data.extend(transport_id);
                }
            }
            _ => return Err(Sense::INVALID_FIELD_IN_CDB.in_cdb(1, Some(4))),
        }
        let length = (data.len() - 8) as u32;
        data[4..8].copy_from_slice(&length.to_be_bytes());
        Ok(data)
    }

    fn others(&self, nexus: &str) -> Vec<String> {
        self.registrations
            .iter()
            .filter(|r| r.nexus != nexus)
            .map(|r| r.nexus.clone())
            .collect()
    }
}

/// An iSCSI TransportID (SPC-4 7.6.4.6, format 00b) for the initiator name
/// part of `nexus`.
fn iscsi_transport_id(nexus: &str) -> Vec<u8> {
    let name = nexus.split(",i,").next().unwrap_or(nexus);
    let mut id = vec![0x05, 0, 0, 0];
    id.extend_from_slice(name.as_bytes());
    id.push(0);
    while id.len() % 4 != 0 || id.len() < 24 {
        id.push(0);
    }
    let additional = (id.len() - 4) as u16;
    id[2..4].copy_from_slice(&additional.to_be_bytes());
    id
}

fn notify(targets: Vec<String>, sense: Sense) -> Notifications {
    targets.into_iter().map(|n| (n.into(), sense)).collect()
}

/// Carries out PERSISTENT RESERVE OUT `action` for `nexus` with the 24-byte
/// parameter list `params`.
pub fn out(
    state: &mut State,
    nexus: &str,
    action: u8,
    scope: u8,
    kind: u8,
    param_len: u32,
    params: &[u8],
) -> Result<Notifications, Failure> {
    if action > 7 {
        return Err(Failure::Sense(Sense::INVALID_FIELD_IN_CDB.in_cdb(1, Some(4))));
    }
    if action == 7 {
        // REGISTER AND MOVE is not supported.
        return Err(Failure::Sense(Sense::INVALID_FIELD_IN_CDB.in_cdb(1, Some(4))));
    }
    if param_len != 24 || params.len() != 24 {
        return Err(Failure::Sense(Sense::PARAMETER_LIST_LENGTH_ERROR));
    }
    let key = u64_at(params, 0);
    let sa_key = u64_at(params, 8);
    let flags = params[20];
    if flags & 0x08 != 0 {
        // SPEC_I_PT is not supported.
        return Err(Failure::Sense(Sense::INVALID_FIELD_IN_PARAMETER_LIST));
    }
    let current = state.key_of(nexus);
    let check_key = |state: &State| -> Result<(), Failure> {
        match state.key_of(nexus) {
            Some(k) if k == key => Ok(()),
            _ => Err(Failure::Conflict),
        }
    };
    let valid_type = |kind: u8| {
        matches!(
            kind,
            WRITE_EXCLUSIVE
                | EXCLUSIVE_ACCESS
                | WRITE_EXCLUSIVE_REGISTRANTS_ONLY
                | EXCLUSIVE_ACCESS_REGISTRANTS_ONLY
                | WRITE_EXCLUSIVE_ALL_REGISTRANTS
                | EXCLUSIVE_ACCESS_ALL_REGISTRANTS
        )
    };
    let mut notifications = Vec::new();
    match action {
        // REGISTER and REGISTER AND IGNORE EXISTING KEY.
        0 | 6 => {
            if action == 0 {
                match current {
                    None if key != 0 => return Err(Failure::Conflict),
                    Some(k) if k != key => return Err(Failure::Conflict),
                    _ => {}
                }
            }
            match (current, sa_key) {
                (None, 0) => return Ok(notifications),
                (None, new_key) => {
                    if state.registrations.len() >= MAX_REGISTRATIONS {
                        return Err(Failure::Sense(Sense::INSUFFICIENT_REGISTRATION_RESOURCES));
                    }
                    state.registrations.push(Registration {
                        nexus: nexus.to_string(),
                        key: new_key,
                    });
                }
                (Some(_), 0) => {
                    let was_holder = state.is_holder(nexus);
                    state.registrations.retain(|r| r.nexus != nexus);
                    if let Some(reservation) = state.reservation.clone() {
                        let release = if all_registrants(reservation.kind) {
                            state.registrations.is_empty()
                        } else {
                            was_holder
                        };
                        if release {
                            state.reservation = None;
                            if registrants_matter(reservation.kind) {
                                notifications = notify(state.others(nexus), Sense::RESERVATIONS_RELEASED);
                            }
                        }
                    }
                }
                (Some(_), new_key) => {
                    if let Some(r) = state.registrations.iter_mut().find(|r| r.nexus == nexus) {
                        r.key = new_key;
                    }
                }
            }
            state.generation = state.generation.wrapping_add(1);
        }
        // RESERVE.
        1 => {
            check_key(state)?;
            if scope != 0 {
                return Err(Failure::Sense(Sense::INVALID_FIELD_IN_CDB.in_cdb(2, Some(7))));
            }
            if !valid_type(kind) {
                return Err(Failure::Sense(Sense::INVALID_FIELD_IN_CDB.in_cdb(2, Some(3))));
            }
            match &state.reservation {
                Some(r) if state.is_holder(nexus) && r.kind == kind => {}
                Some(_) => return Err(Failure::Conflict),
                None => {
                    state.reservation = Some(Reservation {
                        holder: nexus.to_string(),
                        kind,
                    })
                }
            }
        }
        // RELEASE.
        2 => {
            check_key(state)?;
            let Some(reservation) = state.reservation.clone() else {
                return Ok(notifications);
            };
            if !state.is_holder(nexus) {
                return Ok(notifications);
            }
            if reservation.kind != kind || scope != 0 {
                return Err(Failure::Sense(INVALID_RELEASE));
            }
            state.reservation = None;
            if registrants_matter(reservation.kind) {
                notifications = notify(state.others(nexus), Sense::RESERVATIONS_RELEASED);
            }
        }
        // CLEAR.
        3 => {
            check_key(state)?;
            notifications = notify(state.others(nexus), Sense::RESERVATIONS_PREEMPTED);
            state.registrations.clear();
            state.reservation = None;
            state.generation = state.generation.wrapping_add(1);
        }
        // PREEMPT and PREEMPT AND ABORT.
        4 | 5 => {
            check_key(state)?;
            match state.reservation.clone() {
                Some(reservation) if all_registrants(reservation.kind) && sa_key == 0 => {
                    if !valid_type(kind) {
                        return Err(Failure::Sense(Sense::INVALID_FIELD_IN_CDB.in_cdb(2, Some(3))));
                    }
                    notifications = notify(state.others(nexus), Sense::REGISTRATIONS_PREEMPTED);
                    state.registrations.retain(|r| r.nexus == nexus);
                    state.reservation = Some(Reservation {
                        holder: nexus.to_string(),
                        kind,
                    });
                }
                Some(reservation)
                    if !all_registrants(reservation.kind) && state.key_of(&reservation.holder) == Some(sa_key) =>
                {
                    if !valid_type(kind) {
                        return Err(Failure::Sense(Sense::INVALID_FIELD_IN_CDB.in_cdb(2, Some(3))));
                    }
                    let preempted: Vec<String> = state
                        .registrations
                        .iter()
                        .filter(|r| r.key == sa_key && r.nexus != nexus)
                        .map(|r| r.nexus.clone())
                        .collect();
                    state.registrations.retain(|r| !(r.key == sa_key && r.nexus != nexus));
                    state.reservation = Some(Reservation {
                        holder: nexus.to_string(),
                        kind,
                    });
                    notifications = notify(preempted, Sense::REGISTRATIONS_PREEMPTED);
                }
                _ => {
                    if sa_key == 0 {
                        return Err(Failure::Sense(Sense::INVALID_FIELD_IN_PARAMETER_LIST));
                    }
                    let preempted: Vec<String> = state
                        .registrations
                        .iter()
                        .filter(|r| r.key == sa_key)
                        .map(|r| r.nexus.clone())
                        .collect();
                    if preempted.is_empty() {
                        return Err(Failure::Conflict);
                    }
                    state.registrations.retain(|r| r.key != sa_key);
                    notifications = notify(preempted, Sense::REGISTRATIONS_PREEMPTED);
                }
            }
            state.generation = state.generation.wrapping_add(1);
        }
        _ => return Err(Failure::Sense(Sense::INVALID_FIELD_IN_CDB.in_cdb(1, Some(4)))),
    }
    Ok(notifications)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(key: u64, sa_key: u64) -> Vec<u8> {
        let mut p = vec![0u8; 24];
        p[0..8].copy_from_slice(&key.to_be_bytes());
        p[8..16].copy_from_slice(&sa_key.to_be_bytes());
        p
    }

    #[test]
    fn register_reserve_conflict_release() {
        let mut state = State::default();
        out(&mut state, "a", 0, 0, 0, 24, &params(0, 1)).unwrap();
        out(&mut state, "b", 0, 0, 0, 24, &params(0, 2)).unwrap();
        out(&mut state, "a", 1, 0, EXCLUSIVE_ACCESS, 24, &params(1, 0)).unwrap();
        let read = Command::Read {
            lba: 0,
            blocks: 1,
            fua: false,
        };
        assert!(state.conflicts("b", &read));
        assert!(!state.conflicts("a", &read));
        assert_eq!(
            out(&mut state, "b", 1, 0, EXCLUSIVE_ACCESS, 24, &params(2, 0)),
            Err(Failure::Conflict)
        );
        out(&mut state, "a", 2, 0, EXCLUSIVE_ACCESS, 24, &params(1, 0)).unwrap();
        assert!(!state.conflicts("b", &read));
    }

    #[test]
    fn wrong_key_is_a_conflict() {
        let mut state = State::default();
        out(&mut state, "a", 0, 0, 0, 24, &params(0, 1)).unwrap();
        assert_eq!(out(&mut state, "a", 0, 0, 0, 24, &params(5, 2)), Err(Failure::Conflict));
    }

    #[test]
    fn short_parameter_list_is_rejected() {
        let mut state = State::default();
        assert!(matches!(
            out(&mut state, "a", 0, 0, 0, 8, &[0; 8]),
            Err(Failure::Sense(_))
        ));
    }
}
